// ampdiag info: what a run.db holds, whether it is complete, and whether it is intact.
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ampdiag/analyzer/json.h"
#include "ampdiag/rundb/reader.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag info RUN.db [options]

Metadata (versions, device, AMP dtype, scaler settings, rank, run id), row counts,
whether the run finished, and SQLite's integrity check. Exit 2 if the file is damaged
(after printing what it could read).

options:
  --format F       text (default) or json
  -o, --output F   write there instead of stdout
)";

struct Info {
  std::string path;
  int format = 0;
  bool finished = false;
  std::map<std::string, std::string> meta;
  std::vector<std::pair<std::string, std::size_t>> counts;  // table, rows
  std::string integrity;
};

Info read_info(rundb::RunDbReader& r) {
  Info info;
  info.path = r.path();
  info.format = r.schema_version();
  info.finished = r.finished();
  info.meta = r.meta();
  std::size_t grad_rows = 0;
  r.for_each_grad_stat([&](const rundb::GradStatRow&) { ++grad_rows; });
  info.counts = {{"layers", r.layers().size()},         {"modules", r.modules().size()},
                 {"steps", r.steps().size()},           {"grad_stats", grad_rows},
                 {"act_stats", r.act_stats().size()},   {"replays", r.replays().size()},
                 {"events", r.events().size()}};
  info.integrity = r.integrity_check();
  return info;
}

std::string as_text(const Info& info) {
  std::string o;
  auto line = [&](const std::string& label, const std::string& value) {
    std::string l = label + ":";
    l.resize(std::max<std::size_t>(l.size() + 1, 17), ' ');
    o += l + value + "\n";
  };
  line("file", info.path);
  line("format", "run.db " + std::to_string(info.format));
  line("state", info.finished ? "finished" : "not finished (being written, or its process died)");
  for (const auto& [k, v] : info.meta) {
    std::string label = "meta " + k + ":";
    label.resize(std::max<std::size_t>(label.size() + 1, 32), ' ');
    o += label + v + "\n";
  }
  for (const auto& [table, rows] : info.counts) line(table == "grad_stats" || table == "act_stats" ? table + " rows" : table, std::to_string(rows));
  line("integrity", info.integrity);
  return o;
}

std::string as_json(const Info& info) {
  using analyzer::json::quote;
  std::string o = "{\"file\": " + quote(info.path) + ", \"format\": " + std::to_string(info.format) +
                  ", \"finished\": " + (info.finished ? "true" : "false") + ", \"meta\": {";
  bool first = true;
  for (const auto& [k, v] : info.meta) {
    o += (first ? "" : ", ") + quote(k) + ": " + quote(v);
    first = false;
  }
  o += "}, \"rows\": {";
  first = true;
  for (const auto& [table, rows] : info.counts) {
    o += (first ? "" : ", ") + quote(table) + ": " + std::to_string(rows);
    first = false;
  }
  return o + "}, \"integrity\": " + quote(info.integrity) + "}\n";
}

}  // namespace

int cmd_info(int argc, char** argv) {
  const Args args(argc, argv, {"--format", "-o", "--output"}, {});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  const std::string format = args.choice("--format", "text", {"text", "json"});
  rundb::RunDbReader reader(args.positionals().front());
  const Info info = read_info(reader);
  write_output(output_path(args), format == "json" ? as_json(info) : as_text(info));
  if (info.integrity != "ok")
    throw rundb::RunDbError(info.path + ": failed SQLite's integrity check: " + info.integrity);
  return 0;
}

}  // namespace ampdiag::cli
