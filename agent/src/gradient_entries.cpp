#include "gradient_entries.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/core/grad_mode.h>

namespace ampdiag::agent {

void GradientEntries::output(const std::string& path, const at::Tensor& y) {
  if (watched_.empty() || hooked_ || path != watched_ || !y.defined() || !y.requires_grad() ||
      !y.device().is_cpu() || !at::GradMode::is_enabled())
    return;
  hooked_ = true;
  std::shared_ptr<std::atomic<int>> reached = reached_;
  y.register_hook([reached](const at::Tensor& grad) {
    if (!grad.defined() || !grad.device().is_cpu() || reached->load() == 1) return;
    reached->store(at::isfinite(grad).all().item<bool>() ? 0 : 1);
  });
}

std::string GradientEntries::step_ended(const std::string& named) {
  const int reached = reached_->exchange(-1);
  hooked_ = false;
  std::string verdict;
  if (named.empty()) {
    count_down();
  } else if (named == watched_ && reached >= 0) {
    judged_.insert(named);
    watched_.clear();
    verdict = named + (reached == 1 ? ": nonfinite" : ": finite");
  } else if (named != watched_ && !judged_.count(named) && int(judged_.size()) < kVerdicts) {
    watched_ = named;
    left_ = kWatchSteps;
  } else {
    count_down();
  }
  return verdict;
}

void GradientEntries::count_down() {
  if (!watched_.empty() && --left_ <= 0) watched_.clear();
}

}  // namespace ampdiag::agent
