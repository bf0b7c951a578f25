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

void ColumnWalker::move_to(std::int64_t step) {
  column_ = column_of(step, first_, last_, width_);
  // The column's first and one-past-last step: estimated, then checked against
  // column_of itself so that both always agree, rounding included.
  const double per_column = double(std::max<std::int64_t>(1, last_ - first_ + 1)) / double(width_);
  auto first_step_of = [&](int c) {
    if (c <= 0) return std::int64_t(INT64_MIN);
    if (c >= width_) return std::int64_t(INT64_MAX);
    std::int64_t s = first_ + std::int64_t(std::ceil(double(c) * per_column - 0.5));
    while (column_of(s, first_, last_, width_) >= c) --s;
    while (column_of(s + 1, first_, last_, width_) < c) ++s;
    return s + 1;
  };
  start_ = first_step_of(column_);
  next_ = first_step_of(column_ + 1);
}

std::vector<TimelineColumn> timeline_columns(const analyzer::Run& run, std::int64_t first, std::int64_t last, int width) {
  std::vector<TimelineColumn> columns(std::size_t(std::max(1, width)));
  std::vector<std::pair<double, double>> scale(columns.size());  // lowest and highest scale; log2 once per column
  ColumnWalker walk(first, last, int(columns.size()));
  auto it = std::lower_bound(run.steps.begin(), run.steps.end(), first,
                             [](const analyzer::StepSummary& s, std::int64_t step) { return s.row.step < step; });
  for (; it != run.steps.end() && it->row.step <= last; ++it) {
    const std::size_t c = std::size_t(walk.column(it->row.step));
    auto& col = columns[c];
    const double v = std::max(it->row.scale_after, 1e-300);
    if (!col.any) scale[c] = {v, v};
    scale[c].first = std::min(scale[c].first, v);
    scale[c].second = std::max(scale[c].second, v);
    col.any = true;
    col.skipped = col.skipped || it->row.skipped;
  }
  for (std::size_t c = 0; c < columns.size(); ++c)
    if (columns[c].any) columns[c].lo = std::log2(scale[c].first), columns[c].hi = std::log2(scale[c].second);
  return columns;
}

int log2_label_stride(double powers, float pixels, float min_gap) {
  if (!(powers > 0) || !(pixels > 0)) return 1;
  const double per_power = double(pixels) / powers;
  int stride = 1;
  while (stride < (1 << 20) && per_power * stride < double(min_gap)) stride *= 2;
  return stride;
}

}  // namespace ampdiag::gui
