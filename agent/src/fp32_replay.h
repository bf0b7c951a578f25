// A module's call made again in FP32, as the NaN/Inf replay (replay_pins) and the precision
// checks make it. Both must leave the training's random numbers where they were (a replay
// with dropout draws from the same generator), and a check must draw what the call drew, so
// that the two outputs are compared under the same masks.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <mutex>

#include "ampdiag/pin_fp32.h"

namespace ampdiag::agent {

inline at::Tensor cpu_rng_state() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

inline void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// The state now, put back when it goes.
class CpuRngRestored {
 public:
  CpuRngRestored() : state_(cpu_rng_state()) {}
  ~CpuRngRestored() { set_cpu_rng_state(state_); }
  CpuRngRestored(const CpuRngRestored&) = delete;
  CpuRngRestored& operator=(const CpuRngRestored&) = delete;

 private:
  at::Tensor state_;
};

// Whom x belongs to: kShared, the training's (the replay, which may change its input in
// place, gets a copy even of an FP32 x); kCallers, a copy the caller made and drops after.
enum class ReplayInput { kShared, kCallers };

// replay (the module's forward) on FP32 x, with autocast and autograd off; the CPU generator
// drawn from `draws` when it is given (the state the call started from), and put back as it
// was afterwards either way.
template <class Forward>
at::Tensor replay_in_fp32(const Forward& replay, const at::Tensor& x, ReplayInput owner = ReplayInput::kShared,
                          const at::Tensor& draws = at::Tensor()) {
  CpuRngRestored after_the_replay;
  if (draws.defined()) set_cpu_rng_state(draws);
  AutocastDisabled off;
  c10::NoGradGuard no_grad;
  at::Tensor input = to_fp32(x);
  if (owner == ReplayInput::kShared && input.is_same(x)) input = x.clone();
  return replay(input);
}

}  // namespace ampdiag::agent
