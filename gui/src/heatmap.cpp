// heatmap.h: least headroom and non-finite per pixel column.
#include "heatmap.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "timeline.h"

namespace ampdiag::gui {

std::vector<HeatCell> heatmap_row(const analyzer::LayerSummary& layer, double fp_max, std::int64_t first,
                                  std::int64_t last, int width) {
  std::vector<HeatCell> cells(std::size_t(std::max(1, width)));
  const auto& samples = layer.samples;  // in step order
  auto it = std::lower_bound(samples.begin(), samples.end(), first,
                             [](const analyzer::GradSample& s, std::int64_t step) { return s.step < step; });
  for (; it != samples.end() && it->step <= last; ++it) {
    const int c = column_of(it->step, first, last, int(cells.size()));
    HeatCell& cell = cells[std::size_t(c)];
    if (!cell.any) cell.least_headroom = std::numeric_limits<float>::infinity();
    cell.any = true;
    if (it->nonfinite) {
      cell.nonfinite = true;
    } else if (it->absmax > 0) {
      cell.least_headroom = std::min(cell.least_headroom, float(analyzer::headroom_bits(it->absmax, fp_max)));
    }
  }
  return cells;
}

}  // namespace ampdiag::gui
