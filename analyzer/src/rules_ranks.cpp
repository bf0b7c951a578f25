// rank-disagreement: one rank whose gradients differ from the others'.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "rules.h"

namespace ampdiag::analyzer::rules {

void rank_disagreement(const std::vector<Run>& runs, const Thresholds& t, std::vector<Finding>& out) {
  if (runs.size() < 2) return;
  // Sharded parameters (FSDP2's DTensors, FSDP1's wrapper): each rank's statistics cover its
  // own shard, which differs from the others' by design (a one-element bias lives on one rank).
  for (const auto& run : runs)
    if (run.first_event("sharded-parameters")) return;
  struct PerRank {
    std::int64_t rank;
    std::int64_t numel;  // the values of the layer this rank holds and reads
    std::int64_t nonfinite;
    double median_log2;
    std::int64_t samples;
  };
  std::map<std::string, std::vector<PerRank>> by_layer;
  for (const auto& run : runs) {
    for (const auto& layer : run.layers) {
      std::vector<double> logs;
      for (const auto& s : layer.samples)
        if (!s.nonfinite && s.absmax > 0.0f) logs.push_back(std::log2(double(s.absmax)));
      std::sort(logs.begin(), logs.end());
      by_layer[layer.info.name].push_back(
          {run.rank, layer.info.numel, layer.nonfinite_steps, logs.empty() ? NAN : logs[logs.size() / 2],
           std::int64_t(layer.samples.size())});
    }
  }
  for (const auto& [name, ranks] : by_layer) {
    if (ranks.size() < 2) continue;
    for (const auto& r : ranks) {
      // A rank holding another number of the layer's values holds other values: a shard
      // (FSDP1 without its event, from an older agent: a bias on one rank, none on the
      // other). Only ranks that hold the whole layer alike are compared.
      if (r.numel == 0) continue;
      std::int64_t others_nonfinite = 0, compared = 0;
      std::vector<double> others;
      for (const auto& o : ranks)
        if (o.rank != r.rank && o.numel == r.numel) {
          ++compared;
          others_nonfinite += o.nonfinite;
          if (std::isfinite(o.median_log2)) others.push_back(o.median_log2);
        }
      if (compared == 0) continue;
      std::sort(others.begin(), others.end());
      const double others_median = others.empty() ? NAN : others[others.size() / 2];
      const bool lone_overflow = r.nonfinite > 0 && others_nonfinite == 0;
      const bool magnitude = std::isfinite(r.median_log2) && std::isfinite(others_median) &&
                             std::fabs(r.median_log2 - others_median) > t.rank_bits;
      if (!lone_overflow && !magnitude) continue;
      Finding f;
      f.rule = "rank-disagreement";
      f.severity = lone_overflow ? Severity::kError : Severity::kWarning;
      f.layer = name;
      f.ranks = {r.rank};
      f.score = lone_overflow ? 70.0 : 45.0;
      char diff[64];
      std::snprintf(diff, sizeof diff, "%.1f", std::isfinite(others_median) && std::isfinite(r.median_log2) ? r.median_log2 - others_median : 0.0);
      f.title = "rank " + std::to_string(r.rank) + " disagrees with the other ranks on " + name;
      f.evidence = lone_overflow ? "non-finite gradients on rank " + std::to_string(r.rank) + " in " + std::to_string(r.nonfinite) +
                                       " steps, on no other rank"
                                 : "median abs-max " + std::string(diff) + " bits away from the other ranks' median";
      f.suggestions.push_back({"Check what differs on that rank: its data shard, its loss scale, parameters outside DDP, "
                               "or a device fault.", "", ""});
      out.push_back(f);
    }
  }
}

}  // namespace ampdiag::analyzer::rules
