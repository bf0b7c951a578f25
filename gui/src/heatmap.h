// The layer x step heatmap's level of detail: per pixel column of one layer's row, the
// least headroom (bits below the AMP dtype's largest value) over the column's steps and
// whether any of them was non-finite, so that one bad step among thousands still shows.
#pragma once

#include <cstdint>
#include <vector>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::gui {

struct HeatCell {
  bool any = false;        // the column holds a sample of this layer
  bool nonfinite = false;  // one of them held NaN/Inf
  float least_headroom = 0.0f;  // over the finite non-zero samples; +inf when there were none
};

// Steps first..last of `layer` over `width` columns (the same mapping as the timeline).
std::vector<HeatCell> heatmap_row(const analyzer::LayerSummary& layer, double fp_max, std::int64_t first,
                                  std::int64_t last, int width);

}  // namespace ampdiag::gui
