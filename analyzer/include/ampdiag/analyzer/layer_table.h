// The per-layer summary every view shows (`ampdiag layers`, the HTML report, the GUI),
// and the one ranking of layers: the culprits the findings name first.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

struct LayerRowSummary {
  const LayerSummary* layer = nullptr;
  std::int64_t samples = 0, finite_samples = 0;
  double least_headroom = 0.0;   // bits; -inf when a sample was non-finite, +inf when none was non-zero
  double median_headroom = 0.0;  // over finite non-zero samples; +inf when none
  double zeros = 0.0, subnormal = 0.0;  // mean shares over finite samples
  int finding_rank = -1;         // position of the first finding that names it; -1: none
  // Share of its measured optimizer updates that rounded away (half-precision parameters,
  // the stalled-updates rule's measure); NaN when none was measured.
  double stalled_updates = NAN;
};

// One row per layer, in the analyzer's ranking: layers named by findings (in the findings'
// order), then layers with non-finite gradients (most steps first), then least headroom.
std::vector<LayerRowSummary> rank_layers(const Run& run, const Report& report);

// Of several ranks' runs, the index of the one whose layers a view shows first: the first
// rank a failing or warning finding is about (a rank disagreement names the odd one out),
// else the first an information finding is about, else the one whose gradients held
// NaN/Inf in the most layer steps (a sharded run's ranks each hold other layers: FSDP's
// one-element bias overflowing on rank 1 only), else the first. `runs` must not be empty.
std::size_t focus_run(const Report& report, const std::vector<Run>& runs);

}  // namespace ampdiag::analyzer
