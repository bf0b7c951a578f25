// Stalled updates of half-precision parameters (half_updates.h).
#include "half_updates.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/stack.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "sampling.h"
#include "session.h"

namespace ampdiag::agent {

HalfUpdates::HalfUpdates(Session& session)
    : session_(session), reads_([this](std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& counts) {
        post(step, layers, counts);
      }) {}

void HalfUpdates::before_step(std::int64_t every) {
  if (params_.empty()) return;
  try {
    reads_.poll(false);
    if (!regular_sample(session_.step(), every)) return;
    at::NoGradGuard no_grad;
    for (auto& h : params_) {
      const at::Tensor& g = h.param.grad();
      if (!g.defined() || g.is_sparse() || g.sizes() != h.param.sizes()) continue;
      h.before = h.param.detach().clone();
      h.moved = at::isfinite(g).logical_and_(g != 0);
    }
  } catch (const std::exception& error) {
    stop(error);
  }
}

void HalfUpdates::after_step() {
  try {
    count();
  } catch (const std::exception& error) {
    stop(error);
  }
}

void HalfUpdates::stop(const std::exception& error) {
  params_.clear();
  session_.event_once("half-updates", "warning",
                      std::string("stalled updates of half-precision parameters are no longer counted: ") + error.what());
}

void HalfUpdates::count() {
  at::NoGradGuard no_grad;
  // Per device, in the order the parameters came: two counts a layer, no read on the way.
  std::vector<at::Device> devices;
  for (const auto& h : params_)
    if (h.before.defined() && std::find(devices.begin(), devices.end(), h.param.device()) == devices.end())
      devices.push_back(h.param.device());
  for (const auto& device : devices) {
    std::vector<std::int64_t> layers;
    std::vector<at::Tensor> counts;
    for (auto& h : params_) {
      if (!h.before.defined() || h.param.device() != device) continue;
      layers.push_back(h.layer);
      counts.push_back(at::stack({h.moved.sum(), h.moved.logical_and_(h.param.detach() == h.before).sum()}));
      h.before = at::Tensor();
      h.moved = at::Tensor();
    }
    reads_.send(session_.step(), std::move(layers), at::stack(counts));
  }
}

void HalfUpdates::flush() {
  try {
    reads_.poll(true);
  } catch (const std::exception& error) {
    stop(error);
  }
}

void HalfUpdates::post(std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& counts) {
  const std::int64_t* c = counts.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < layers.size(); ++i) session_.weight_update(step, layers[i], c[2 * i], c[2 * i + 1]);
}

}  // namespace ampdiag::agent
