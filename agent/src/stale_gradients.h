// The C++ agent's look for gradients not zeroed between optimizer steps (event
// "gradients-not-zeroed"), as the Python agent's _stale_gradients.py: the smallest trainable
// host parameter is the probe. Its gradient hook runs before autograd accumulates into
// .grad, so at its first gradient of a cycle .grad holds what the cycle before left:
// undefined or zeros after a zero_grad(), else that cycle's gradient. That is a suspicion,
// settled when the step ends: a later gradient of the same cycle that finds .grad undefined
// or zeros shows it was zeroed in between (a GAN's discriminator, cleared by its own
// zero_grad() after the generator's backward went through it); and the parameter must be
// one the scaler unscaled (a parameter no optimizer steps keeps its gradient by design).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ampdiag::agent {

class StaleGradients {
 public:
  // The probe among `params` (trainable, dense, on the host, the fewest elements), or none.
  static const at::Tensor* probe_of(const std::vector<std::pair<std::string, at::Tensor>>& params);

  StaleGradients(at::Tensor param, std::string name) : param_(std::move(param)), name_(std::move(name)) {}

  void cycle_began() { looked_ = false; }
  // The probe's gradient hook, on the training thread (a host parameter's backward runs there).
  void on_gradient(std::int64_t step);
  // The scaler unscales these parameters' gradients.
  void unscaled(const std::vector<at::Tensor>& params);
  // The step ended: the event's detail and step when the suspicion stood, else empty.
  std::string step_ended(std::int64_t& step);

 private:
  at::Tensor param_;
  std::string name_;
  bool looked_ = false;       // the cycle's first gradient arrived
  std::int64_t suspect_ = -1;  // the step whose first gradient found the last step's in .grad
  bool stepped_ = false;       // the scaler unscaled it in this cycle
  bool reported_ = false;
};

}  // namespace ampdiag::agent
