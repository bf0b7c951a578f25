// ampdiag export: one run.db table as CSV or JSON, row by row (a large run streams).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>

#include "ampdiag/rundb/reader.h"
#include "commands.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag export RUN.db --format csv|json [options]

options:
  --format F     csv or json (required)
  --table T      steps (default), layers, modules, grad_stats, act_stats, events
  -o FILE        write there instead of stdout
)";

std::string real(double v) {
  if (!std::isfinite(v)) return "";
  char b[40];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

std::string text_field(const std::string& s, bool json) {
  std::string o = json ? "\"" : (s.find_first_of(",\"\n") == std::string::npos ? "" : "\"");
  const bool quoted = !o.empty();
  for (char c : s) {
    if (json && (c == '"' || c == '\\')) o += '\\';
    if (json && c == '\n') {
      o += "\\n";
      continue;
    }
    if (!json && c == '"') o += '"';
    o += c;
  }
  return quoted ? o + "\"" : o;
}

// Writes rows of (column, value, is_text) as CSV or JSON.
class Sink {
 public:
  Sink(std::FILE* out, bool json) : out_(out), json_(json) {
    if (json_) std::fputs("[", out_);
  }
  void row(const std::vector<std::pair<std::string, std::pair<std::string, bool>>>& cells) {
    if (json_) {
      std::fputs(rows_ ? ",\n{" : "\n{", out_);
      for (std::size_t i = 0; i < cells.size(); ++i) {
        const auto& [k, v] = cells[i];
        const std::string value = v.second ? text_field(v.first, true) : (v.first.empty() ? "null" : v.first);
        std::fprintf(out_, "%s\"%s\": %s", i ? ", " : "", k.c_str(), value.c_str());
      }
      std::fputs("}", out_);
    } else {
      if (rows_ == 0) {
        for (std::size_t i = 0; i < cells.size(); ++i) std::fprintf(out_, "%s%s", i ? "," : "", cells[i].first.c_str());
        std::fputs("\n", out_);
      }
      for (std::size_t i = 0; i < cells.size(); ++i)
        std::fprintf(out_, "%s%s", i ? "," : "", cells[i].second.second ? text_field(cells[i].second.first, false).c_str()
                                                                         : cells[i].second.first.c_str());
      std::fputs("\n", out_);
    }
    ++rows_;
  }
  ~Sink() {
    if (json_) std::fputs("\n]\n", out_);
  }

 private:
  std::FILE* out_;
  bool json_;
  std::size_t rows_ = 0;
};

using Cells = std::vector<std::pair<std::string, std::pair<std::string, bool>>>;

void stats_cells(Cells& c, const rundb::StatValues& s) {
  c.push_back({"numel", {std::to_string(s.numel), false}});
  c.push_back({"nan", {std::to_string(s.nan), false}});
  c.push_back({"inf", {std::to_string(s.inf), false}});
  c.push_back({"zeros", {std::to_string(s.zeros), false}});
  c.push_back({"fp16_subnormal", {std::to_string(s.fp16_subnormal), false}});
  c.push_back({"absmax", {real(s.absmax), false}});
  c.push_back({"amin_nz", {real(s.amin_nz), false}});
  c.push_back({"l2", {real(s.l2), false}});
}

}  // namespace

int cmd_export(int argc, char** argv) {
  const Args args(argc, argv, {"--format", "--table", "-o"}, {});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  if (!args.has("--format")) throw UsageError("--format csv|json is required");
  const bool json = args.choice("--format", "csv", {"csv", "json"}) == "json";
  const std::string table =
      args.choice("--table", "steps", {"steps", "layers", "modules", "grad_stats", "act_stats", "events"});
  rundb::RunDbReader reader(args.positionals().front());
  const std::string path = args.value("-o");
  const std::string tmp = path.empty() ? "" : path + ".tmp";
  std::FILE* out = path.empty() ? stdout : std::fopen(tmp.c_str(), "wb");
  if (!out) throw UsageError("cannot write " + path);
  {
    Sink sink(out, json);
    if (table == "steps") {
      for (const auto& s : reader.steps())
        sink.row({{"step", {std::to_string(s.step), false}}, {"loss", {real(s.loss), false}},
                  {"scale_before", {real(s.scale_before), false}}, {"scale_after", {real(s.scale_after), false}},
                  {"found_inf", {std::to_string(int(s.found_inf)), false}}, {"skipped", {std::to_string(int(s.skipped)), false}},
                  {"sampled", {std::to_string(int(s.sampled)), false}}, {"step_ns", {std::to_string(s.step_ns), false}},
                  {"agent_ns", {std::to_string(s.agent_ns), false}}, {"wall_time", {real(s.wall_time), false}}});
    } else if (table == "layers") {
      for (const auto& l : reader.layers())
        sink.row({{"id", {std::to_string(l.id), false}}, {"name", {l.name, true}}, {"module_path", {l.module_path, true}},
                  {"module_type", {l.module_type, true}}, {"dtype", {l.dtype, true}}, {"shape", {l.shape, true}},
                  {"numel", {std::to_string(l.numel), false}}, {"trainable", {std::to_string(int(l.trainable)), false}},
                  {"source", {l.source, true}}});
    } else if (table == "modules") {
      for (const auto& m : reader.modules())
        sink.row({{"id", {std::to_string(m.id), false}}, {"path", {m.path, true}}, {"module_type", {m.module_type, true}},
                  {"source", {m.source, true}}});
    } else if (table == "grad_stats") {
      reader.for_each_grad_stat([&](const rundb::GradStatRow& g) {
        Cells c = {{"step", {std::to_string(g.step), false}}, {"layer_id", {std::to_string(g.layer_id), false}},
                   {"bwd_order", {std::to_string(g.bwd_order), false}}};
        stats_cells(c, g.stats);
        sink.row(c);
      });
    } else if (table == "act_stats") {
      for (const auto& a : reader.act_stats()) {
        Cells c = {{"step", {std::to_string(a.step), false}}, {"module_id", {std::to_string(a.module_id), false}},
                   {"fwd_order", {std::to_string(a.fwd_order), false}}};
        stats_cells(c, a.stats);
        sink.row(c);
      }
    } else {
      for (const auto& e : reader.events())
        sink.row({{"step", {std::to_string(e.step), false}}, {"kind", {e.kind, true}}, {"detail", {e.detail, true}},
                  {"wall_time", {real(e.wall_time), false}}});
    }
  }
  if (!path.empty()) {
    const bool ok = std::fclose(out) == 0;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw UsageError("cannot write " + path);
    }
  }
  return 0;
}

}  // namespace ampdiag::cli
