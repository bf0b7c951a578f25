// Stalled updates of half-precision parameters (no FP32 master weights), as the Python
// agent's _updates.py counts them: on the steps the regular sampling records, a copy and a
// mask of finite non-zero gradients before the optimizer's step, and after it the masked
// elements the step left unchanged (table weight_updates, rule stalled-updates). The counts
// are reduced on the parameters' device; a device's come back without the training thread
// waiting (device_reads.h), recorded at the step they were measured at.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "device_reads.h"

namespace ampdiag::agent {

class Session;

class HalfUpdates {
 public:
  explicit HalfUpdates(Session& session);

  // A trainable fp16/bf16 parameter of layer `layer`, on the host or a device.
  void add(std::int64_t layer, const at::Tensor& param) { params_.push_back({layer, param, {}, {}}); }
  // Before the optimizer's step(), on a step sampled every `every`.
  void before_step(std::int64_t every);
  // After it: the counts of the step measured before it, if any. Neither stops the
  // training: a failure is one warning event, and the counting stops.
  void after_step();
  // close(): waits for the device counts still landing, and records them.
  void flush();

 private:
  struct Param {
    std::int64_t layer;
    at::Tensor param, before, moved;  // before/moved: only while a measured step runs
  };
  void count();
  void stop(const std::exception& error);
  void post(std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& counts);

  Session& session_;
  std::vector<Param> params_;
  DeviceReads reads_;  // [n, 2] int64 (nonzero, stalled) of each device's measured layers
};

}  // namespace ampdiag::agent
