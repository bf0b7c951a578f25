#include "stale_gradients.h"

#include <ATen/core/Tensor.h>

namespace ampdiag::agent {

namespace {

bool holds_values(const at::Tensor& grad) { return grad.defined() && !grad.is_sparse() && grad.any().item<bool>(); }

}  // namespace

const at::Tensor* StaleGradients::probe_of(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  const at::Tensor* best = nullptr;
  for (const auto& [name, p] : params)
    if (p.requires_grad() && p.layout() == at::kStrided && p.device().is_cpu() && (!best || p.numel() < best->numel()))
      best = &p;
  return best;
}

void StaleGradients::on_gradient(std::int64_t step) {
  if (reported_) return;
  if (!looked_) {
    looked_ = true;
    suspect_ = holds_values(param_.grad()) ? step : -1;
  } else if (suspect_ >= 0 && !holds_values(param_.grad())) {
    suspect_ = -1;  // zeroed since the first look: what it held was never applied
  }
}

void StaleGradients::unscaled(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) stepped_ = stepped_ || p.is_same(param_);
}

std::string StaleGradients::step_ended(std::int64_t& step) {
  const bool stale = suspect_ >= 0 && stepped_ && !reported_;
  step = suspect_;
  suspect_ = -1;
  stepped_ = false;
  if (!stale) return "";
  reported_ = true;
  return name_ + "'s gradient still held the previous optimizer step's values when this step's first gradient "
                 "arrived: the gradients were not zeroed between steps";
}

}  // namespace ampdiag::agent
