// Where a loss scaler's descent from init_scale ends: shared by the report's rules (the
// recorded steps) and whatif (a replayed trajectory), so that both call the same skips
// "calibration".
#pragma once

#include <cstddef>

namespace ampdiag::analyzer {

// A descent that went this many optimizer steps in a row without an overflow has found
// its level.
inline constexpr std::size_t kSettledSteps = 5;

// A run that ends before its descent settles, at this scale or above, was still the scaler
// looking for its level (a 5-step smoke run that backs off once from 65536 is healthy);
// below it, a scale still coming down at the end is what scale-collapse calls "falling"
// (16 × its default floor of 128), and only the leading skips count as calibration.
inline constexpr double kUnsettledLevel = 2048.0;

struct ScaleStep {
  bool skipped = false;
  double before = 0.0, after = 0.0;  // the scale the step ran at; after its update
};

// The index after the descent: at the first growth, or once the scale held through
// kSettledSteps steps in a row. Successes between its back-offs do not end it: batches
// differ, and the next one may not fit the scale the last one did. A descent still under
// way when the run ends is all calibration if the scale is still at kUnsettledLevel or
// above, else only its leading skips are. `at(i)` gives step i's ScaleStep.
template <class At>
std::size_t calibration_end(std::size_t n, At at) {
  std::size_t taken_in_a_row = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const ScaleStep s = at(i);
    if (s.after > s.before) return i;
    taken_in_a_row = s.skipped ? 0 : taken_in_a_row + 1;
    if (taken_in_a_row == kSettledSteps) return i + 1;
  }
  if (n > 0 && at(n - 1).after >= kUnsettledLevel) return n;
  std::size_t leading = 0;
  while (leading < n && at(leading).skipped && at(leading).after < at(leading).before) ++leading;
  return leading;
}

// Step i is a back-off of the descent that ends at `end`.
inline bool is_calibration(const ScaleStep& s, std::size_t i, std::size_t end) {
  return i < end && s.skipped && s.after < s.before;
}

}  // namespace ampdiag::analyzer
