// Stalled updates of half-precision parameters (half_updates.h).
#include "half_updates.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "sampling.h"
#include "session.h"

namespace ampdiag::agent {

void HalfUpdates::before_step(std::int64_t every) {
  if (params_.empty() || !regular_sample(session_.step(), every)) return;
  at::NoGradGuard no_grad;
  for (auto& h : params_) {
    const at::Tensor& g = h.param.grad();
    if (!g.defined() || g.is_sparse() || g.sizes() != h.param.sizes()) continue;
    h.before = h.param.detach().clone();
    h.moved = at::isfinite(g).logical_and_(g != 0);
  }
}

void HalfUpdates::after_step() {
  at::NoGradGuard no_grad;
  for (auto& h : params_) {
    if (!h.before.defined()) continue;
    const std::int64_t nonzero = h.moved.sum().item<std::int64_t>();
    const std::int64_t stalled = h.moved.logical_and_(h.param.detach() == h.before).sum().item<std::int64_t>();
    session_.weight_update(session_.step(), h.layer, nonzero, stalled);
    h.before = at::Tensor();
    h.moved = at::Tensor();
  }
}

}  // namespace ampdiag::agent
