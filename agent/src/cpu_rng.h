// The default CPU generator's state: a replay that draws random numbers (dropout) must draw
// the training's (a precision check compares the same masks) and must not shift them.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <mutex>

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

}  // namespace ampdiag::agent
