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
  ColumnWalker walk(first, last, int(cells.size()));
  // A column's numbers gather in locals and are stored when the next column starts; log2
  // once per column (headroom falls as abs-max grows: the least is the largest's).
  int column = -1;
  HeatCell cell;
  const auto store = [&] {
    if (column < 0) return;
    cell.least_headroom = cell.largest_absmax > 0 ? float(analyzer::headroom_bits(cell.largest_absmax, fp_max))
                                                  : std::numeric_limits<float>::infinity();
    cells[std::size_t(column)] = cell;
  };
  constexpr float kZero = 1.0f / 65535.0f, kSub = 1.0f / 255.0f;
  for (; it != samples.end() && it->step <= last; ++it) {
    const int c = walk.column(it->step);
    if (c != column) {
      store();
      column = c;
      cell = HeatCell{};
      cell.any = true;
    }
    if (it->nonfinite) {
      cell.nonfinite = true;
      continue;
    }
    const float a = it->absmax;
    if (a > 0) {
      cell.largest_absmax = std::max(cell.largest_absmax, a);
      if (cell.smallest_absmax == 0 || a < cell.smallest_absmax) cell.smallest_absmax = a;
    }
    if (it->zero_q != 65535)
      cell.most_underflow = std::max(cell.most_underflow, std::min(1.0f, float(it->zero_q) * kZero + float(it->sub_q) * kSub));
  }
  store();
  return cells;
}

}  // namespace ampdiag::gui
