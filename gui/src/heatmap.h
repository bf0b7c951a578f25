// The layer x step heatmap's level of detail: per pixel column of one layer's row, the
// least headroom (bits below the AMP dtype's largest value) and the most underflow over
// the column's steps, and whether any of them was non-finite, so that one bad step among
// thousands still shows.
#pragma once

#include <cstdint>
#include <vector>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::gui {

struct HeatCell {
  bool any = false;        // the column holds a sample of this layer
  bool nonfinite = false;  // one of them held NaN/Inf
  float largest_absmax = 0.0f;   // over the finite samples
  float smallest_absmax = 0.0f;  // over the finite samples with a non-zero abs-max; 0: none
  float least_headroom = 0.0f;  // over the finite non-zero samples (the largest's); +inf when there were none
  // The largest share of values that were zero or fp16-subnormal, over the finite samples
  // that were not all zero (a layer a step did not use); -1 when there were none.
  float most_underflow = -1.0f;
};

// Steps first..last of `layer` over `width` columns (the same mapping as the timeline).
std::vector<HeatCell> heatmap_row(const analyzer::LayerSummary& layer, double fp_max, std::int64_t first,
                                  std::int64_t last, int width);

}  // namespace ampdiag::gui
