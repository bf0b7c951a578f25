#include "gradient_entries.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

namespace ampdiag::agent {

void GradientEntries::output(const std::string& path, const at::Tensor& y) {
  if (watches_.empty() || !y.defined() || !y.requires_grad() || !y.device().is_cpu() || !at::GradMode::is_enabled())
    return;
  for (Watch& w : watches_) {
    if (w.hooked || w.done || w.path != path) continue;
    w.hooked = true;
    std::shared_ptr<std::atomic<int>> reached = w.reached;
    y.register_hook([reached](const at::Tensor& grad) {
      if (!grad.defined() || !grad.device().is_cpu() || reached->load() == 1) return;
      reached->store(at::isfinite(grad).all().item<bool>() ? 0 : 1);
    });
  }
}

std::vector<GradientEntries::Event> GradientEntries::step_ended(const std::string& named,
                                                                const std::vector<std::string>& others) {
  std::vector<int> reached;
  for (Watch& w : watches_) {
    reached.push_back(w.reached->exchange(-1));
    w.hooked = false;
  }
  const std::string watched = watches_.empty() ? std::string() : watches_.front().path;
  std::vector<Event> events;
  const auto seen = [&](std::size_t k) { return reached[k] == 1 ? ": nonfinite" : ": finite"; };
  if (named.empty()) {
    count_down();
  } else if (named == watched) {
    if (!watches_.front().done && reached.front() >= 0) {
      ++named_verdicts_;
      judged_.insert(named);
      watches_.front().done = true;
      events.push_back({kKind, named + seen(0)});
    }
    // A companion is judged where its gradients went NaN/Inf in a skip naming the module too,
    // and watched until then (q beside k, not in every skip k is first in).
    for (std::size_t k = 1; k < watches_.size(); ++k) {
      Watch& w = watches_[k];
      if (w.done || reached[k] < 0 || std::find(others.begin(), others.end(), w.path) == others.end()) continue;
      w.done = true;
      beside_judged_.insert(w.path + " beside " + named);
      events.push_back({kBesideKind, w.path + seen(k) + ", beside " + named});
    }
    if (std::all_of(watches_.begin(), watches_.end(), [](const Watch& w) { return w.done; }))
      watches_.clear();
    else
      count_down();
  } else if (!judged_.count(named) && named_verdicts_ < kVerdicts) {
    watches_.assign(1, Watch{named});
    for (const std::string& other : others)
      if (watches_.size() <= kCompanions && !beside_judged_.count(other + " beside " + named))
        watches_.push_back(Watch{other});
    left_ = kWatchSteps;
  } else {
    count_down();
  }
  return events;
}

void GradientEntries::count_down() {
  if (!watches_.empty() && --left_ <= 0) watches_.clear();
}

}  // namespace ampdiag::agent
