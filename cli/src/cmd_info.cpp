// ampdiag info: what a run.db holds, whether it is complete, and whether it is intact.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ampdiag/analyzer/escape.h"
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
(after printing what it could read), with one line on stderr saying what.

options:
  --full-check     run SQLite's integrity_check (also compares every index with its
                   table; slower) instead of its quick_check
  --verbose        on damage, list every problem SQLite found on stderr, not just the first
  --format F       text (default) or json
  -o, --output F   write there instead of stdout
)";

struct Info {
  std::string path;
  int format = 0;
  bool finished = false;
  std::map<std::string, std::string> meta;
  std::vector<std::pair<std::string, std::size_t>> counts;  // table, rows
  std::vector<std::pair<std::string, std::string>> unreadable;  // table, why
  std::string check;  // "quick_check" or "integrity_check"
  std::vector<std::string> problems;  // what the check found
  std::string check_error;  // why the check itself failed
  bool intact() const { return unreadable.empty() && problems.empty() && check_error.empty(); }
};

// Counts what it can: a table that cannot be read is listed, not fatal, so that the rest
// of a damaged file is still shown.
Info read_info(rundb::RunDbReader& r, bool full_check) {
  Info info;
  info.path = r.path();
  info.format = r.schema_version();
  info.finished = r.finished();
  info.meta = r.meta();
  auto count = [&](const char* table, const std::function<std::size_t()>& rows) {
    try {
      info.counts.emplace_back(table, rows());
    } catch (const rundb::RunDbError& e) {
      info.unreadable.emplace_back(table, e.what());
    }
  };
  count("layers", [&] { return r.layers().size(); });
  count("modules", [&] { return r.modules().size(); });
  count("steps", [&] { return r.steps().size(); });
  count("grad_stats", [&] {
    std::size_t rows = 0;
    rundb::RunDbReader::GradScan scan;
    scan.histograms = false;
    r.for_each_grad_stat([&](const rundb::GradStatRow&) { ++rows; }, scan);
    return rows;
  });
  count("act_stats", [&] { return r.act_stats().size(); });
  count("replays", [&] { return r.replays().size(); });
  count("events", [&] { return r.events().size(); });
  if (r.schema_version() >= 3) count("gpu_time", [&] { return r.gpu_time().size(); });
  if (r.schema_version() >= 4) count("weight_updates", [&] { return r.weight_updates().size(); });
  count("precision_checks", [&] { return r.precision_checks().size(); });
  count("weight_norms", [&] { return r.weight_norms().size(); });
  if (r.has_summaries()) {
    count("grad_samples", [&] {
      std::size_t rows = 0;
      r.for_each_sample_blob(INT64_MIN, INT64_MAX, [&](std::int64_t, const std::vector<rundb::SampleRecord>&) { ++rows; });
      return rows;
    });
    count("grad_hist_sums", [&] {
      std::map<std::int64_t, std::vector<std::uint64_t>> sums;
      std::int64_t rows = 0;
      r.histogram_sums(sums, &rows);
      return std::size_t(rows);
    });
  }
  info.check = full_check ? "integrity_check" : "quick_check";
  try {
    info.problems = r.integrity_problems(full_check);
  } catch (const rundb::RunDbError& e) {
    std::string why = e.what();
    if (why.rfind(info.path + ": ", 0) == 0) why.erase(0, info.path.size() + 2);  // named once, by the caller
    info.check_error = why;
  }
  return info;
}

std::string as_text(const Info& info) {
  std::string o;
  auto line = [&](const std::string& label, const std::string& value) {
    std::string l = label + ":";
    l.resize(std::max<std::size_t>(l.size() + 1, 17), ' ');
    o += l + value + "\n";
  };
  line("file", analyzer::printable(info.path));
  line("format", "run.db " + std::to_string(info.format));
  line("state", info.finished ? "finished" : "not finished (being written, or its process died)");
  for (const auto& [k, v] : info.meta) {
    std::string label = "meta " + k + ":";
    label.resize(std::max<std::size_t>(label.size() + 1, 32), ' ');
    o += analyzer::printable(label) + analyzer::printable(v) + "\n";
  }
  for (const auto& [table, rows] : info.counts) {
    // The two stat tables count rows; the summaries say what they are (docs/FORMAT.md).
    if (table == "grad_stats" || table == "act_stats") line(table + " rows", std::to_string(rows));
    else if (table == "grad_samples") line("summaries", std::to_string(rows) + " step summaries (grad_samples)");
    else if (table == "grad_hist_sums") line("hist sums", std::to_string(rows) + " per-layer histogram sums (grad_hist_sums)");
    else if (table == "precision_checks") line("precision", std::to_string(rows) + " checks against FP32 (precision_checks)");
    else if (table == "weight_norms") line("weights", std::to_string(rows) + " sampled norms (weight_norms)");
    else line(table, std::to_string(rows));
  }
  if (!std::any_of(info.counts.begin(), info.counts.end(), [](const auto& c) { return c.first == "grad_samples"; }) &&
      !std::any_of(info.unreadable.begin(), info.unreadable.end(), [](const auto& c) { return c.first == "grad_samples"; }))
    line("summaries", "none (an older writer: readers scan every grad_stats row)");
  for (const auto& [table, why] : info.unreadable) line(table, "UNREADABLE");
  if (!info.check_error.empty())
    line("integrity", "DAMAGED: " + analyzer::printable(info.check_error));
  else if (info.problems.empty())
    line("integrity", "ok (SQLite " + info.check + (info.check == "quick_check" ? "; --full-check runs integrity_check)" : ")"));
  else
    line("integrity", "DAMAGED: SQLite's " + info.check + " found " + std::to_string(info.problems.size()) +
                          (info.problems.size() == 1 ? " problem" : " problems") + "; the first: " + analyzer::printable(info.problems.front()));
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
  o += "}, \"unreadable\": {";
  first = true;
  for (const auto& [table, why] : info.unreadable) {
    o += (first ? "" : ", ") + quote(table) + ": " + quote(why);
    first = false;
  }
  std::vector<std::string> problems = info.problems;
  if (!info.check_error.empty()) problems.push_back(info.check_error);
  o += "}, \"integrity\": " + quote(problems.empty() ? "ok" : "damaged") + ", \"integrity_check\": " + quote(info.check) +
       ", \"integrity_problems\": [";
  for (std::size_t i = 0; i < problems.size(); ++i) o += (i ? ", " : "") + quote(problems[i]);
  return o + "]}\n";
}

// One line for the exit-2 error; with --verbose every problem follows on its own line.
std::string damage_summary(const Info& info, bool verbose) {
  std::vector<std::string> all;
  for (const auto& [table, why] : info.unreadable) all.push_back(why);
  for (const auto& problem : info.problems) all.push_back(info.path + ": failed SQLite's " + info.check + ": " + problem);
  if (!info.check_error.empty()) all.push_back(info.path + ": " + info.check_error);
  std::string out = all.front();
  if (verbose) {
    for (std::size_t i = 1; i < all.size(); ++i) out += "\n" + all[i];
  } else if (all.size() > 1) {
    out += " (and " + std::to_string(all.size() - 1) + " more; --verbose lists them)";
  }
  return out;
}

}  // namespace

int cmd_info(int argc, char** argv) {
  const Args args(argc, argv, {"--format", "-o", "--output"}, {"--full-check", "--verbose"});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  const std::string format = args.choice("--format", "text", {"text", "json"});
  rundb::RunDbReader reader(args.positionals().front());
  const Info info = read_info(reader, args.flag("--full-check"));
  write_output(output_path(args), format == "json" ? as_json(info) : as_text(info));
  if (!info.intact()) throw rundb::RunDbError(damage_summary(info, args.flag("--verbose")));
  return 0;
}

}  // namespace ampdiag::cli
