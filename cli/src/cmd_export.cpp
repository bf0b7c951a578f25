// ampdiag export: one run.db table as CSV or JSON, row by row (a large run streams).
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "ampdiag/analyzer/json.h"
#include "ampdiag/rundb/reader.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag export RUN.db --format csv|json [options]

Every column of one table, as docs/FORMAT.md describes it. A value the file does not
have (a NaN loss, a loss count a format 1 file lacks) is empty in CSV and null in JSON;
a histogram is its counts separated by spaces (CSV) or an array (JSON). An empty table
is its CSV header alone, or [].

options:
  --format F       csv or json (required)
  --table T        steps (default), layers, modules, grad_stats, act_stats, replays,
                   precision_checks, weight_norms, events, meta
  -o, --output F   write there instead of stdout
)";

struct Cell {
  enum Kind { kNumber, kText, kList } kind;
  std::string value;  // kNumber: empty when the file has no value; kList: space-separated
};

Cell number(std::int64_t v) { return {Cell::kNumber, std::to_string(v)}; }
Cell real(double v) {
  if (!std::isfinite(v)) return {Cell::kNumber, ""};
  char b[40];
  std::snprintf(b, sizeof b, "%.17g", v);
  return {Cell::kNumber, b};
}
Cell text(const std::string& s) { return {Cell::kText, s}; }
Cell flag(bool b) { return number(b ? 1 : 0); }

std::string json_value(const Cell& c) {
  switch (c.kind) {
    case Cell::kText: return analyzer::json::quote(c.value);
    case Cell::kNumber: return c.value.empty() ? "null" : c.value;
    case Cell::kList: {
      if (c.value.empty()) return "null";
      std::string o = "[";
      for (char ch : c.value) o += ch == ' ' ? std::string(", ") : std::string(1, ch);
      return o + "]";
    }
  }
  return "null";
}

// Writes the header (CSV) as soon as it exists, so that an empty table still has one.
class Sink {
 public:
  Sink(std::FILE* out, bool json, std::vector<std::string> columns) : out_(out), json_(json), columns_(std::move(columns)) {
    if (json_) {
      std::fputs("[", out_);
      return;
    }
    for (std::size_t i = 0; i < columns_.size(); ++i) std::fprintf(out_, "%s%s", i ? "," : "", columns_[i].c_str());
    std::fputs("\n", out_);
  }
  void row(const std::vector<Cell>& cells) {
    std::string line = json_ ? (rows_ ? ",\n{" : "\n{") : "";
    for (std::size_t i = 0; i < cells.size(); ++i) {
      if (json_) line += (i ? ", " : "") + analyzer::json::quote(columns_[i]) + ": " + json_value(cells[i]);
      else line += (i ? "," : "") + csv_field(cells[i].value);
    }
    line += json_ ? "}" : "\n";
    std::fwrite(line.data(), 1, line.size(), out_);  // a NUL in a name is data, not the end
    ++rows_;
  }
  void finish() {
    if (json_) std::fputs(rows_ ? "\n]\n" : "]\n", out_);
  }

 private:
  std::FILE* out_;
  bool json_;
  std::vector<std::string> columns_;
  std::size_t rows_ = 0;
};

std::vector<std::string> with_stat_columns(std::vector<std::string> columns) {
  for (const auto& f : rundb::kStatFields) columns.push_back(f.name);
  return columns;
}

void add_stats(std::vector<Cell>& cells, const rundb::StatValues& s) {
  for (const auto& f : rundb::kStatFields) cells.push_back(f.count ? number(s.*f.count) : real(s.*f.real));
}

Cell histogram(const std::vector<std::uint32_t>& counts) {
  std::string o;
  for (std::size_t i = 0; i < counts.size(); ++i) o += (i ? " " : "") + std::to_string(counts[i]);
  return {Cell::kList, o};
}

void export_table(rundb::RunDbReader& reader, const std::string& table, std::FILE* out, bool json) {
  if (table == "steps") {
    Sink sink(out, json, {"step", "loss", "losses", "scale_before", "scale_after", "found_inf", "skipped", "sampled", "step_ns",
                          "agent_ns", "wall_time"});
    for (const auto& s : reader.steps())
      sink.row({number(s.step), real(s.loss), s.losses < 0 ? Cell{Cell::kNumber, ""} : number(s.losses), real(s.scale_before),
                real(s.scale_after), flag(s.found_inf), flag(s.skipped), flag(s.sampled), number(s.step_ns), number(s.agent_ns),
                real(s.wall_time)});
    sink.finish();
  } else if (table == "layers") {
    Sink sink(out, json, {"id", "name", "module_path", "module_type", "dtype", "shape", "numel", "trainable", "source"});
    for (const auto& l : reader.layers())
      sink.row({number(l.id), text(l.name), text(l.module_path), text(l.module_type), text(l.dtype), text(l.shape),
                number(l.numel), flag(l.trainable), text(l.source)});
    sink.finish();
  } else if (table == "modules") {
    Sink sink(out, json, {"id", "path", "module_type", "source", "inputs"});
    for (const auto& m : reader.modules())
      sink.row({number(m.id), text(m.path), text(m.module_type), text(m.source), text(m.inputs)});
    sink.finish();
  } else if (table == "grad_stats") {
    auto columns = with_stat_columns({"step", "layer_id", "bwd_order"});
    columns.push_back("histogram");
    Sink sink(out, json, columns);
    reader.for_each_grad_stat([&](const rundb::GradStatRow& g) {
      std::vector<Cell> cells = {number(g.step), number(g.layer_id), number(g.bwd_order)};
      add_stats(cells, g.stats);
      cells.push_back(histogram(g.histogram));
      sink.row(cells);
    });
    sink.finish();
  } else if (table == "act_stats") {
    auto columns = with_stat_columns({"step", "module_id", "fwd_order", "micro_batch"});
    columns.push_back("histogram");
    Sink sink(out, json, columns);
    reader.for_each_act_stat([&](const rundb::ActStatRow& a) {
      std::vector<Cell> cells = {number(a.step), number(a.module_id), number(a.fwd_order), number(a.micro_batch)};
      add_stats(cells, a.stats);
      cells.push_back(histogram(a.histogram));
      sink.row(cells);
    });
    sink.finish();
  } else if (table == "replays") {
    Sink sink(out, json, {"step", "module", "outcome", "fp32_absmax", "reason"});
    for (const auto& r : reader.replays())
      sink.row({number(r.step), text(r.module), text(r.outcome), real(r.fp32_absmax), text(r.reason)});
    sink.finish();
  } else if (table == "precision_checks") {
    Sink sink(out, json, {"step", "module", "dtype", "numel", "rel_error", "zeroed", "fp32_absmax"});
    for (const auto& c : reader.precision_checks())
      sink.row({number(c.step), text(c.module), text(c.dtype), number(c.numel), real(c.rel_error), number(c.zeroed),
                real(c.fp32_absmax)});
    sink.finish();
  } else if (table == "weight_norms") {
    Sink sink(out, json, {"step", "layer_id", "l2", "absmax"});
    for (const auto& w : reader.weight_norms())
      sink.row({number(w.step), number(w.layer_id), real(w.l2), real(w.absmax)});
    sink.finish();
  } else if (table == "meta") {
    Sink sink(out, json, {"key", "value"});
    for (const auto& [key, value] : reader.meta()) sink.row({text(key), text(value)});
    sink.finish();
  } else {
    Sink sink(out, json, {"step", "kind", "detail", "wall_time"});
    for (const auto& e : reader.events()) sink.row({number(e.step), text(e.kind), text(e.detail), real(e.wall_time)});
    sink.finish();
  }
}

}  // namespace

int cmd_export(int argc, char** argv) {
  const Args args(argc, argv, {"--format", "--table", "-o", "--output"}, {});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  if (!args.has("--format")) throw UsageError("--format csv|json is required");
  const bool json = args.choice("--format", "csv", {"csv", "json"}) == "json";
  const std::string table =
      args.choice("--table", "steps", {"steps", "layers", "modules", "grad_stats", "act_stats", "replays",
                                                      "precision_checks", "weight_norms", "events", "meta"});
  rundb::RunDbReader reader(args.positionals().front());
  const std::string path = output_path(args);
  if (path.empty() || path == "-") {
    export_table(reader, table, stdout, json);
    return 0;
  }
  // Streams into a temporary file, renamed at the end: a failed export leaves no half file.
  const std::string tmp = path + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (!out) throw UsageError("cannot write " + path + ": check that its folder exists and is writable");
  try {
    export_table(reader, table, out, json);
  } catch (...) {
    std::fclose(out);
    std::remove(tmp.c_str());
    throw;
  }
  const bool ok = std::fclose(out) == 0;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw UsageError("cannot write " + path + ": check that its folder exists and is writable");
  }
  return 0;
}

}  // namespace ampdiag::cli
