// Pinning part of a model to FP32 under autocast: the fix ampdiag suggests for a module
// that overflows in fp16.
#pragma once

#include <ATen/core/Tensor.h>

#include <set>
#include <string>
#include <vector>

namespace ampdiag {

// Turns autocast off for CPU and CUDA for its lifetime and restores what was there.
class AutocastDisabled {
 public:
  AutocastDisabled();
  ~AutocastDisabled();
  AutocastDisabled(const AutocastDisabled&) = delete;
  AutocastDisabled& operator=(const AutocastDisabled&) = delete;

 private:
  bool cpu_;
  bool cuda_;
};

// Floating-point tensors as float32; anything else unchanged.
at::Tensor to_fp32(const at::Tensor& t);

// The set of module paths to run in FP32 (e.g. from a --pin-fp32 option).
class Fp32Pins {
 public:
  Fp32Pins() = default;
  explicit Fp32Pins(std::vector<std::string> module_paths);

  bool pinned(const std::string& module_path) const { return paths_.count(module_path) != 0; }
  const std::set<std::string>& paths() const { return paths_; }

  // forward(x), or, for a pinned module, forward(to_fp32(x)) with autocast off.
  template <class Forward>
  at::Tensor run(const std::string& module_path, Forward&& forward, const at::Tensor& x) const {
    if (!pinned(module_path)) return forward(x);
    AutocastDisabled off;
    return forward(to_fp32(x));
  }

 private:
  std::set<std::string> paths_;
};

}  // namespace ampdiag
