// The C++ agent's weight sampler, as the Python agent's _weights.py: the parameters' L2
// norms and abs-max on the session core's schedule (weight_schedule.h), and each
// optimizer's settings (event "optimizer-settings": once, then again on the schedule's steps
// where a scheduler moved the first group's lr 2x or more): what rule
// weight-growth reads to tell "the learning rate grew the weights out of fp16's range" from
// "this module overflows".
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device_reads.h"
#include "weight_schedule.h"

namespace torch::optim {
class Optimizer;
}

namespace ampdiag::agent {

class Session;

// "AdamW lr=0.3 weight_decay=0.01", as the Python agent words a torch.optim optimizer.
std::string optimizer_settings(const torch::optim::Optimizer& optimizer);

class WeightNorms {
 public:
  explicit WeightNorms(Session& session)
      : session_(session), reads_([this](std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& host) {
          post(step, layers, host);
        }) {}

  // A floating-point parameter of layer `layer`. A host one is read on the spot; a CUDA
  // one is reduced on its device and its values copied to pinned memory on the current
  // stream, recorded (at the step they were read at) once the copy has landed: the training
  // thread never waits for the device.
  void add(std::int64_t layer, const at::Tensor& param);
  // Before `optimizer`'s step(): the weights the step's forward used.
  void optimizer_starting(const torch::optim::Optimizer& optimizer);
  // The scaler skipped the step: the weights are still those its forward used.
  void step_skipped();
  // close(): waits for the device reads still landing, and records them.
  void flush();

 private:
  void read();
  void read_devices();
  // Rows for `values` ([n, 2] float64 on the host: L2, abs-max) of `layers`, at `step`.
  void post(std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& values);

  Session& session_;
  WeightSchedule schedule_;
  std::vector<std::pair<std::int64_t, at::Tensor>> params_;
  std::vector<std::pair<std::int64_t, at::Tensor>> device_params_;
  DeviceReads reads_;  // [n, 2] float64 (L2, abs-max) of each device's parameters
  std::unordered_map<const torch::optim::Optimizer*, double> described_;  // -> the lr last said
};

}  // namespace ampdiag::agent
