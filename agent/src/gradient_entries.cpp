#include "gradient_entries.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/core/grad_mode.h>

namespace ampdiag::agent {

void GradientEntries::output(const std::string& path, const at::Tensor& y) {
  senders_.output(path, y);
  code_after_.output(path, y);
  if (!core_.armed() || !y.defined() || !y.requires_grad() || !y.device().is_cpu() || !at::GradMode::is_enabled())
    return;
  const std::vector<EntryWatches::Watch>& watches = core_.watches();
  for (std::size_t k = 0; k < watches.size(); ++k) {
    Look& look = looks_[k];
    if (watches[k].done || watches[k].path != path) continue;
    std::shared_ptr<std::atomic<int>> reached = look.reached;
    // The named module's (the first watch): where NaN/Inf reached it, the code after it is read.
    std::function<void(const at::Tensor&)> read = k == 0 ? code_after_.on_gradient(path, y) : nullptr;
    // Every call is hooked and the first to receive its gradient judged: the others (earlier
    // calls of a module run again and again, an ODE's function) may hold what its own
    // backward made in between.
    y.register_hook([reached, read](const at::Tensor& grad) {
      if (!grad.defined() || !grad.device().is_cpu() || reached->load() != EntryWatches::kNotSeen) return;
      const bool finite = at::isfinite(grad).all().item<bool>();
      reached->store(finite ? EntryWatches::kFinite : EntryWatches::kNonfinite);
      if (!finite && read) read(grad);
    });
  }
}

std::vector<EntryWatches::Event> GradientEntries::step_ended(const std::string& named,
                                                             const std::vector<std::string>& others) {
  std::vector<int> reached;
  for (Look& look : looks_) {
    reached.push_back(look.reached->exchange(EntryWatches::kNotSeen));
  }
  std::vector<EntryWatches::Event> events;
  // Before a verdict below arms it: a later skip answers.
  if (std::string sender = senders_.step_ended(named); !sender.empty())
    events.push_back({SenderWatch::kKind, std::move(sender)});
  const std::vector<std::string> before = paths();
  EntryWatches::Ended ended = core_.step_ended(named, others, reached);
  // Re-armed for other modules: new looks (each its own flag), and any hook still pending from
  // this step's graph writes into the old ones.
  if (paths() != before) looks_ = std::vector<Look>(core_.watches().size());
  if (!ended.nonfinite.empty()) senders_.arm(ended.nonfinite);
  for (auto& e : ended.events) events.push_back(std::move(e));
  for (auto& e : code_after_.step_ended()) events.push_back(std::move(e));
  return events;
}

std::vector<std::string> GradientEntries::paths() const {
  std::vector<std::string> out;
  for (const EntryWatches::Watch& w : core_.watches()) out.push_back(w.path);
  return out;
}

}  // namespace ampdiag::agent
