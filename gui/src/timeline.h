// The loss-scale timeline's level of detail: per pixel column, the lowest and highest
// log2 scale and whether any step there was skipped, so that no skipped step disappears
// when a million steps share a thousand pixels (the way profilers draw zoomed-out tracks).
#pragma once

#include <cstdint>
#include <vector>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::gui {

struct TimelineColumn {
  double lo = 0.0, hi = 0.0;  // log2 of the scale after the step, over the column's steps
  bool any = false;           // the column holds a step
  bool skipped = false;       // ...and one of them was skipped
};

// The steps first..last of `run` over `width` columns (column = (step - first) * width / span).
std::vector<TimelineColumn> timeline_columns(const analyzer::Run& run, std::int64_t first, std::int64_t last, int width);

// Where step `step` lands, in pixels from the plot's left edge.
double step_to_x(std::int64_t step, std::int64_t first, std::int64_t last, double width);
// The pixel column (0..width-1) that holds step `step`.
int column_of(std::int64_t step, std::int64_t first, std::int64_t last, int width);

// How many powers of two apart the loss-scale axis labels its gridlines (1, 2, 4, 8, ...):
// the fewest that leaves `min_gap` pixels between labels, where `powers` powers of two span
// `pixels` (a scale that fell 60 halvings in a short plot would stack its labels).
int log2_label_stride(double powers, float pixels, float min_gap);

// column_of for increasing steps, without its arithmetic for every step: a zoomed-out
// view puts hundreds of steps in each column, and only a step past the column's last
// one needs the next column worked out.
class ColumnWalker {
 public:
  ColumnWalker(std::int64_t first, std::int64_t last, int width) : first_(first), last_(last), width_(width) {}
  int column(std::int64_t step) {
    if (step >= next_ || step < start_) move_to(step);
    return column_;
  }

 private:
  void move_to(std::int64_t step);
  std::int64_t first_, last_;
  int width_;
  int column_ = 0;
  std::int64_t start_ = 0, next_ = INT64_MIN;  // the current column holds steps start_..next_-1
};

}  // namespace ampdiag::gui
