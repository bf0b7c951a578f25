// When the agents read the weights' norms (table weight_norms): at the start of steps 0, 1,
// 2, 3, 4, 6, 8, 12, ..., 256 (two a doubling, where a learning rate far too high grows the
// weights fastest), then of every 64th, and at the end of the run's first skipped steps
// (their forward used the weights the skip left alone). The reading itself is the agent's:
// it knows the tensors.
#pragma once

#include <cstdint>

namespace ampdiag::agent {

class WeightSchedule {
 public:
  static constexpr std::int64_t kDenseUntil = 256;  // two samples a doubling up to here
  static constexpr std::int64_t kPeriod = 64;       // then one every kPeriod steps
  static constexpr std::int64_t kSkipped = 8;       // skipped steps sampled, the first ones of the run

  static bool due(std::int64_t step) {
    if (step < 0) return false;
    if (step < 4) return true;
    if (step > kDenseUntil) return step % kPeriod == 0;
    int k = 0;
    while ((std::int64_t{2} << k) <= step) ++k;  // 2^k <= step < 2^(k+1)
    return step == (std::int64_t{1} << k) || step == (std::int64_t{3} << (k - 1));
  }

  // Whether to read the weights now, as step `step` begins (or, in an agent that sees no
  // beginning, before its optimizer changes them). Once per step.
  bool at_start(std::int64_t step) { return due(step) && take(step); }
  // Whether to read them at the end of step `step`, which was skipped.
  bool after_skip(std::int64_t step) {
    if (skips_ >= kSkipped) return false;
    ++skips_;
    return take(step);
  }

 private:
  bool take(std::int64_t step) {
    if (step == last_) return false;
    last_ = step;
    return true;
  }
  std::int64_t skips_ = 0;
  std::int64_t last_ = -1;
};

}  // namespace ampdiag::agent
