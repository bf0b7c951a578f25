// Which steps get their per-layer statistics recorded: every N-th step, every step that
// overflows or changes the scale, and `context` steps before and after such a step.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace ampdiag::agent {

// The regular part of the sampling: every N-th step, known when the step begins (the
// device profile records these).
inline bool regular_sample(std::int64_t step, std::int64_t every) { return step % every == 0; }

class SamplingPolicy {
 public:
  SamplingPolicy(std::int64_t every, std::int64_t context) : every_(every), context_(context) {
    if (every < 1) throw std::invalid_argument("every must be >= 1 (record statistics every N steps)");
    if (context < 0) throw std::invalid_argument("context_steps must be >= 0");
  }

  struct Decision {
    bool record = false;           // record the step that just ended
    std::int64_t flush_before = 0; // also record up to this many unrecorded steps before it
  };

  Decision decide(std::int64_t step, bool found_inf, bool scale_changed) {
    Decision d;
    if (found_inf || scale_changed) {
      d.record = true;
      d.flush_before = context_;
      after_ = context_;
    } else if (after_ > 0) {
      d.record = true;
      --after_;
    } else {
      d.record = regular_sample(step, every_);
    }
    return d;
  }

  std::int64_t context() const { return context_; }

 private:
  std::int64_t every_;
  std::int64_t context_;
  std::int64_t after_ = 0;
};

}  // namespace ampdiag::agent
