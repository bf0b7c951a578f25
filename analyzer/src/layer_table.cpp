// rank_layers; see layer_table.h.
#include "ampdiag/analyzer/layer_table.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace ampdiag::analyzer {

namespace {

// A finding names a layer directly, or through the module that holds it.
bool names(const Finding& f, const rundb::LayerRow& layer) {
  if (!f.layer.empty()) return f.layer == layer.name;
  if (f.module.empty()) return false;
  return layer.name.size() > f.module.size() && layer.name.compare(0, f.module.size(), f.module) == 0 &&
         layer.name[f.module.size()] == '.';
}

}  // namespace

std::vector<LayerRowSummary> rank_layers(const Run& run, const Report& report) {
  std::vector<LayerRowSummary> rows;
  for (const auto& l : run.layers) {
    LayerRowSummary r;
    r.layer = &l;
    r.samples = std::int64_t(l.samples.size());
    // Headroom falls as abs-max grows: the k-th least headroom is the k-th largest
    // abs-max's, so one log2 per layer instead of one per sample.
    std::vector<float> absmax;
    bool nonfinite = false;
    for (const auto& s : l.samples) {
      if (s.nonfinite) {
        nonfinite = true;
        continue;
      }
      ++r.finite_samples;
      r.zeros += s.zero_q / 65535.0;
      r.subnormal += s.sub_q / 255.0;
      if (s.absmax > 0) absmax.push_back(s.absmax);
    }
    if (r.finite_samples) r.zeros /= double(r.finite_samples), r.subnormal /= double(r.finite_samples);
    if (absmax.empty()) {
      r.least_headroom = nonfinite ? -INFINITY : INFINITY;
      r.median_headroom = INFINITY;
    } else {
      const auto mid = absmax.begin() + std::ptrdiff_t(absmax.size() / 2);
      std::nth_element(absmax.begin(), mid, absmax.end(), std::greater<float>());
      r.median_headroom = headroom_bits(*mid, run.fp_max);
      r.least_headroom = nonfinite ? -INFINITY : headroom_bits(*std::max_element(absmax.begin(), absmax.end()), run.fp_max);
    }
    if (l.update_nonzero > 0) r.stalled_updates = double(l.update_stalled) / double(l.update_nonzero);
    for (std::size_t i = 0; i < report.findings.size() && r.finding_rank < 0; ++i)
      if (report.findings[i].severity != Severity::kInfo && names(report.findings[i], l.info)) r.finding_rank = int(i);
    rows.push_back(r);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const LayerRowSummary& a, const LayerRowSummary& b) {
    const bool an = a.finding_rank >= 0, bn = b.finding_rank >= 0;
    if (an != bn) return an;
    if (an && a.finding_rank != b.finding_rank) return a.finding_rank < b.finding_rank;
    if (a.layer->first_nonfinite != b.layer->first_nonfinite) return a.layer->first_nonfinite > b.layer->first_nonfinite;
    if (a.layer->nonfinite_steps != b.layer->nonfinite_steps) return a.layer->nonfinite_steps > b.layer->nonfinite_steps;
    return a.least_headroom < b.least_headroom;
  });
  return rows;
}

std::size_t focus_run(const Report& report, const std::vector<Run>& runs) {
  for (const bool info : {false, true})
    for (const auto& f : report.findings) {
      if ((f.severity == Severity::kInfo) != info || f.ranks.empty()) continue;
      for (std::size_t i = 0; i < runs.size(); ++i)
        if (runs[i].rank == f.ranks.front()) return i;
    }
  std::size_t most = 0;
  std::int64_t most_nonfinite = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    std::int64_t nonfinite = 0;
    for (const auto& layer : runs[i].layers) nonfinite += layer.nonfinite_steps;
    if (nonfinite > most_nonfinite) most = i, most_nonfinite = nonfinite;
  }
  return most;
}

}  // namespace ampdiag::analyzer
