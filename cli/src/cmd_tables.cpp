// ampdiag layers and ampdiag timeline: the run as tables, for people and for scripts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

#include "ampdiag/analyzer/run.h"
#include "commands.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kLayersHelp = R"(usage: ampdiag layers RUN.db [options]

One row per parameter: samples, steps with NaN/Inf, times it went non-finite first in
backward, least and median headroom (bits below the largest fp value), mean share of
zeros and fp16 subnormals.

options:
  --sort KEY       headroom (default: least headroom first), first, nonfinite, zeros,
                   subnormal, numel, name, id
  --top N          only the first N rows
  --csv            CSV instead of an aligned table
  --allow-partial  read a run.db still being written
)";

constexpr const char* kTimelineHelp = R"(usage: ampdiag timeline RUN.db [options]

One row per step: loss, loss scale before and after, skipped or not, the first
non-finite gradient in backward order and the first non-finite module output in forward.

options:
  --csv            CSV instead of an aligned table
  --every N        only every N-th step (skipped steps are always shown)
  --allow-partial  read a run.db still being written
)";

struct LayerRowOut {
  const analyzer::LayerSummary* layer;
  double least = INFINITY, median = INFINITY, zeros = 0, subnormal = 0;
};

std::string num(double v, const char* f = "%.2f") {
  if (!std::isfinite(v)) return "-";
  char b[48];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}

void print_table(const std::vector<std::vector<std::string>>& rows, bool csv) {
  if (csv) {
    for (const auto& r : rows) {
      for (std::size_t i = 0; i < r.size(); ++i) std::printf("%s%s", i ? "," : "", csv_field(r[i]).c_str());
      std::printf("\n");
    }
    return;
  }
  std::vector<std::size_t> width;
  for (const auto& r : rows)
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t i = 0; i < r.size(); ++i) {
      std::string cell = r[i];
      cell.resize(width[i], ' ');
      line += (i ? "  " : "") + cell;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

}  // namespace

int cmd_layers(int argc, char** argv) {
  const Args args(argc, argv, {"--sort", "--top"}, {"--csv", "--allow-partial"});
  if (args.help()) {
    std::fputs(kLayersHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  const std::string sort = args.choice("--sort", "headroom", {"headroom", "first", "nonfinite", "zeros", "subnormal", "numel", "name", "id"});
  const long long top = args.integer("--top", 0, 0, 1LL << 40);
  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), 0);
  const analyzer::Run& run = runs.front();
  std::vector<LayerRowOut> rows;
  for (const auto& l : run.layers) {
    LayerRowOut r{&l};
    std::vector<double> h;
    std::int64_t n = 0;
    for (const auto& s : l.samples) {
      if (s.nonfinite) continue;
      ++n;
      r.zeros += s.zero_q / 65535.0;
      r.subnormal += s.sub_q / 255.0;
      if (s.absmax > 0) h.push_back(analyzer::headroom_bits(s.absmax, run.fp_max));
    }
    if (n) r.zeros /= double(n), r.subnormal /= double(n);
    std::sort(h.begin(), h.end());
    if (!h.empty()) r.least = h.front(), r.median = h[h.size() / 2];
    rows.push_back(r);
  }
  const std::map<std::string, std::function<bool(const LayerRowOut&, const LayerRowOut&)>> order = {
      {"headroom", [](auto& a, auto& b) { return a.least < b.least; }},
      {"first", [](auto& a, auto& b) { return a.layer->first_nonfinite > b.layer->first_nonfinite; }},
      {"nonfinite", [](auto& a, auto& b) { return a.layer->nonfinite_steps > b.layer->nonfinite_steps; }},
      {"zeros", [](auto& a, auto& b) { return a.zeros > b.zeros; }},
      {"subnormal", [](auto& a, auto& b) { return a.subnormal > b.subnormal; }},
      {"numel", [](auto& a, auto& b) { return a.layer->info.numel > b.layer->info.numel; }},
      {"name", [](auto& a, auto& b) { return a.layer->info.name < b.layer->info.name; }},
      {"id", [](auto& a, auto& b) { return a.layer->info.id < b.layer->info.id; }},
  };
  std::stable_sort(rows.begin(), rows.end(), order.at(sort));
  if (top > 0 && rows.size() > std::size_t(top)) rows.resize(std::size_t(top));
  std::vector<std::vector<std::string>> table = {{"id", "layer", "module", "numel", "samples", "nonfinite_steps",
                                                  "first_in_backward", "least_headroom_bits", "median_headroom_bits",
                                                  "zeros_pct", "subnormal_pct"}};
  for (const auto& r : rows)
    table.push_back({std::to_string(r.layer->info.id), r.layer->info.name, r.layer->info.module_path,
                     std::to_string(r.layer->info.numel), std::to_string(r.layer->samples.size()),
                     std::to_string(r.layer->nonfinite_steps), std::to_string(r.layer->first_nonfinite), num(r.least),
                     num(r.median), num(r.zeros * 100, "%.1f"), num(r.subnormal * 100, "%.1f")});
  print_table(table, args.flag("--csv"));
  return 0;
}

int cmd_timeline(int argc, char** argv) {
  const Args args(argc, argv, {"--every"}, {"--csv", "--allow-partial"});
  if (args.help()) {
    std::fputs(kTimelineHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  const long long every = args.integer("--every", 1, 1, 1LL << 40);
  const auto runs = load_runs(args.positionals(), args.flag("--allow-partial"), 0);
  const analyzer::Run& run = runs.front();
  std::vector<std::vector<std::string>> table = {
      {"step", "loss", "scale_before", "scale_after", "skipped", "first_nonfinite_gradient", "first_nonfinite_forward"}};
  for (const auto& s : run.steps) {
    if (s.row.step % every != 0 && !s.row.skipped) continue;
    table.push_back({std::to_string(s.row.step), num(s.row.loss, "%.6g"), num(s.row.scale_before, "%g"),
                     num(s.row.scale_after, "%g"), s.row.skipped ? "1" : "0",
                     s.nonfinite_layers.empty() ? "" : run.layers[std::size_t(s.nonfinite_layers.front())].info.name,
                     s.first_nonfinite_module < 0 ? "" : run.modules[std::size_t(s.first_nonfinite_module)].info.path});
  }
  print_table(table, args.flag("--csv"));
  return 0;
}

}  // namespace ampdiag::cli
