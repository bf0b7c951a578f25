// The Agent without a loss scaler (bf16 autocast, or AMP off): LibTorch's optimizers have
// no step hooks and there is no scale() or update() to observe, so the loop hands the agent
// its losses (loss()) and steps the optimizer through it (step()), where the Python agent
// hooks the optimizer's step. The step is recorded at scale 1, as the Python agent does.
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <torch/optim/optimizer.h>

#include <limits>
#include <stdexcept>
#include <vector>

#include "agent_impl.h"

namespace ampdiag {

at::Tensor Agent::Impl::loss(const at::Tensor& loss) {
  if (scaler_)
    throw std::logic_error("ampdiag::Agent::loss: this Agent watches a GradScaler, whose scale() records the loss; "
                           "call loss() only on an Agent made without one");
  if (closed_) return loss;
  on_scale(loss);  // what scale() records: the loss, summed over the step's micro-batches
  return loss;
}

void Agent::Impl::step(torch::optim::Optimizer& optimizer) {
  if (scaler_)
    throw std::logic_error("ampdiag::Agent::step: this Agent watches a GradScaler: step the optimizer with "
                           "scaler.step(optimizer) and scaler.update()");
  if (closed_) {
    optimizer.step();
    return;
  }
  std::vector<at::Tensor> params, grads;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined()) {
        params.push_back(p);
        grads.push_back(p.grad().is_sparse() ? p.grad().coalesce().values() : p.grad());
      }
  bool found = false;
  {
    const auto timed = agent_time();
    begin_cycle();
    if (stale_) stale_->unscaled(params);
    gradient_views(params, grads, nullptr);
    agent::GradBatch b;
    b.layers = ids_.data();
    b.tensors = views_.data();
    b.count = views_.size();
    found = session_.grads(b);  // a device gradient's NaN/Inf lands later, with its statistics
    copies_.clear();
  }
  on_optimizer(optimizer, true);
  optimizer.step();
  on_optimizer(optimizer, false);
  // No scale: 1 before and after, as the Python agent records a run without a scaler.
  const at::Device device = grads.empty() ? at::Device(at::kCPU) : grads.front().device();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor one = at::ones({}, options);
  on_update({one, one, at::full({}, found ? 1.0f : 0.0f, options)});
}

}  // namespace ampdiag
