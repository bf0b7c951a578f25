// Stalled updates of half-precision parameters (no FP32 master weights), as the Python
// agent's _updates.py counts them: on the steps the regular sampling records, a copy and a
// mask of finite non-zero gradients before the optimizer's step, and after it the masked
// elements the step left unchanged (table weight_updates, rule stalled-updates).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ampdiag::agent {

class Session;

class HalfUpdates {
 public:
  explicit HalfUpdates(Session& session) : session_(session) {}

  // A trainable fp16/bf16 host parameter of layer `layer` (a device one would be read back
  // on the training thread).
  void add(std::int64_t layer, const at::Tensor& param) { params_.push_back({layer, param, {}, {}}); }
  // Before the optimizer's step(), on a step sampled every `every`.
  void before_step(std::int64_t every);
  // After it: the counts of the step measured before it, if any.
  void after_step();

 private:
  struct Param {
    std::int64_t layer;
    at::Tensor param, before, moved;  // before/moved: only while a measured step runs
  };
  Session& session_;
  std::vector<Param> params_;
};

}  // namespace ampdiag::agent
