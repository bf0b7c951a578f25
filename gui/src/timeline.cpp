// timeline.h: min/max level of detail per pixel column.
#include "timeline.h"

#include <algorithm>
#include <cmath>

namespace ampdiag::gui {

double step_to_x(std::int64_t step, std::int64_t first, std::int64_t last, double width) {
  const double span = double(std::max<std::int64_t>(1, last - first + 1));
  return (double(step - first) + 0.5) * width / span;
}

int column_of(std::int64_t step, std::int64_t first, std::int64_t last, int width) {
  return std::clamp(int(step_to_x(step, first, last, double(width))), 0, width - 1);
}

std::vector<TimelineColumn> timeline_columns(const analyzer::Run& run, std::int64_t first, std::int64_t last, int width) {
  std::vector<TimelineColumn> columns(std::size_t(std::max(1, width)));
  for (const auto& s : run.steps) {
    const std::int64_t step = s.row.step;
    if (step < first || step > last) continue;
    const int c = column_of(step, first, last, int(columns.size()));
    auto& col = columns[std::size_t(c)];
    const double v = std::log2(std::max(s.row.scale_after, 1e-300));
    if (!col.any) col.lo = col.hi = v;
    col.lo = std::min(col.lo, v);
    col.hi = std::max(col.hi, v);
    col.any = true;
    col.skipped = col.skipped || s.row.skipped;
  }
  return columns;
}

}  // namespace ampdiag::gui
