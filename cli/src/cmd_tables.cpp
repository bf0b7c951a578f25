// ampdiag layers and ampdiag timeline: the run as tables, for people and for scripts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/causes.h"
#include "ampdiag/analyzer/json.h"
#include "ampdiag/analyzer/layer_table.h"
#include "ampdiag/analyzer/run.h"
#include "commands.h"
#include "table_output.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kLayersHelp = R"(usage: ampdiag layers RUN.db [options]

One row per parameter: samples, steps with NaN/Inf, times it went non-finite first in
backward, least and median headroom (bits below the largest fp value), mean share of
zeros and fp16 subnormals; for a run with half-precision parameters, also the share of
their measured updates that rounded away (stalled_updates_pct).

options:
  --sort KEY       rank (default: the report's ranking, culprits first), headroom (least
                   first; non-finite counts as least), first, nonfinite, zeros, subnormal,
                   stalled, numel, name, id
  --top N          only the first N rows
  --format F       text (default), csv or json; --csv is --format csv
  -o, --output F   write there instead of stdout
  --allow-partial  read a run.db still being written
)";

constexpr const char* kTimelineHelp = R"(usage: ampdiag timeline RUN.db [options]

One row per step: loss, loss scale before and after, skipped or not, the first
non-finite gradient in backward order and where the forward's NaN/Inf started (the
module the report names).

options:
  --every N        only every N-th step (skipped steps are always shown)
  --format F       text (default), csv or json; --csv is --format csv
  -o, --output F   write there instead of stdout
  --allow-partial  read a run.db still being written
)";

std::string num(double v, const char* f = "%.2f") {
  if (std::isnan(v)) return "-";
  if (std::isinf(v)) return v < 0 ? "-inf" : "-";
  char b[48];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// A step's recorded loss: NaN/Inf spelt out, since "-" reads as "not recorded" (the file
// keeps a NaN loss as NULL, read back as NaN).
std::string loss_text(double loss) {
  if (std::isnan(loss)) return "nan";
  if (std::isinf(loss)) return loss < 0 ? "-inf" : "inf";
  return num(loss, "%.6g");
}

}  // namespace

int cmd_layers(int argc, char** argv) {
  const Args args(argc, argv, {"--sort", "--top", "--format", "-o", "--output"}, {"--csv", "--allow-partial"});
  if (args.help()) {
    std::fputs(kLayersHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  const std::string sort =
      args.choice("--sort", "rank",
                  {"rank", "headroom", "first", "nonfinite", "zeros", "subnormal", "stalled", "numel", "name", "id"});
  const long long top = args.integer("--top", 0, 0, 1LL << 40);
  const std::string format = table_format(args);
  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), 0);
  const analyzer::Run& run = runs.front();
  auto rows = analyzer::rank_layers(run, analyzer::analyze(runs));
  using Row = analyzer::LayerRowSummary;
  const std::map<std::string, std::function<bool(const Row&, const Row&)>> order = {
      {"headroom", [](auto& a, auto& b) { return a.least_headroom < b.least_headroom; }},
      {"first", [](auto& a, auto& b) { return a.layer->first_nonfinite > b.layer->first_nonfinite; }},
      {"nonfinite", [](auto& a, auto& b) { return a.layer->nonfinite_steps > b.layer->nonfinite_steps; }},
      {"zeros", [](auto& a, auto& b) { return a.zeros > b.zeros; }},
      {"subnormal", [](auto& a, auto& b) { return a.subnormal > b.subnormal; }},
      // Unmeasured (NaN) last.
      {"stalled", [](auto& a, auto& b) { return !std::isnan(a.stalled_updates) && !(a.stalled_updates <= b.stalled_updates); }},
      {"numel", [](auto& a, auto& b) { return a.layer->info.numel > b.layer->info.numel; }},
      {"name", [](auto& a, auto& b) { return a.layer->info.name < b.layer->info.name; }},
      {"id", [](auto& a, auto& b) { return a.layer->info.id < b.layer->info.id; }},
  };
  if (sort != "rank") std::stable_sort(rows.begin(), rows.end(), order.at(sort));
  if (top > 0 && rows.size() > std::size_t(top)) rows.resize(std::size_t(top));
  std::vector<std::vector<std::string>> table = {{"id", "layer", "module", "numel", "samples", "nonfinite_steps",
                                                  "first_in_backward", "least_headroom_bits", "median_headroom_bits",
                                                  "zeros_pct", "subnormal_pct"}};
  // Only runs that measured updates (half-precision parameters) have the column.
  const bool updates = run.measured_updates();
  if (updates) table.front().push_back("stalled_updates_pct");
  for (const auto& r : rows) {
    table.push_back({std::to_string(r.layer->info.id), r.layer->info.name, r.layer->info.module_path,
                     std::to_string(r.layer->info.numel), std::to_string(r.samples),
                     std::to_string(r.layer->nonfinite_steps), std::to_string(r.layer->first_nonfinite),
                     num(r.least_headroom), num(r.median_headroom), num(r.zeros * 100, "%.1f"), num(r.subnormal * 100, "%.1f")});
    if (updates) table.back().push_back(num(r.stalled_updates * 100, "%.1f"));
  }
  write_output(output_path(args), render_table(table, format));
  return 0;
}

int cmd_timeline(int argc, char** argv) {
  const Args args(argc, argv, {"--every", "--format", "-o", "--output"}, {"--csv", "--allow-partial"});
  if (args.help()) {
    std::fputs(kTimelineHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  const long long every = args.integer("--every", 1, 1, 1LL << 40);
  const std::string format = table_format(args);
  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), 0);
  const analyzer::Run& run = runs.front();
  std::vector<std::vector<std::string>> table = {
      {"step", "loss", "scale_before", "scale_after", "skipped", "first_nonfinite_gradient", "first_nonfinite_forward"}};
  for (const auto& s : run.steps) {
    if (s.row.step % every != 0 && !s.row.skipped) continue;
    const analyzer::StepCause cause = analyzer::step_cause(run, s);
    table.push_back({std::to_string(s.row.step), run.loss_known(s.row) ? loss_text(s.row.loss) : "", num(s.row.scale_before, "%g"),
                     num(s.row.scale_after, "%g"), s.row.skipped ? "1" : "0", cause.first_gradient,
                     analyzer::forward_label(cause.forward, cause.forward_module)});
  }
  write_output(output_path(args), render_table(table, format));
  return 0;
}

}  // namespace ampdiag::cli
