#include "entry_watches.h"

#include <algorithm>

namespace ampdiag::agent {

EntryWatches::Ended EntryWatches::step_ended(const std::string& named, const std::vector<std::string>& others,
                                             const std::vector<int>& reached) {
  const auto seen = [&](std::size_t k) { return k < reached.size() ? reached[k] : int{kNotSeen}; };
  const auto verdict = [&](std::size_t k) { return seen(k) == kNonfinite ? ": nonfinite" : ": finite"; };
  Ended ended;
  if (named.empty()) {
    count_down();
  } else if (!watches_.empty() && named == watches_.front().path) {
    if (!watches_.front().done && seen(0) != kNotSeen) {
      if (judged_.insert(named).second && seen(0) == kFinite) again_.insert(named);
      watches_.front().done = true;
      ended.events.push_back({kKind, named + verdict(0)});
      if (seen(0) == kNonfinite) ended.nonfinite = named;
    }
    // A companion is judged where its gradients went NaN/Inf in a skip naming the module too,
    // and watched until then (q beside k, not in every skip k is first in).
    for (std::size_t k = 1; k < watches_.size(); ++k) {
      Watch& w = watches_[k];
      if (w.done || seen(k) == kNotSeen || std::find(others.begin(), others.end(), w.path) == others.end()) continue;
      w.done = true;
      beside_judged_.emplace(w.path, named);
      ended.events.push_back({kBesideKind, w.path + verdict(k) + ", beside " + named});
    }
    if (std::all_of(watches_.begin(), watches_.end(), [](const Watch& w) { return w.done; }))
      watches_.clear();
    else
      count_down();
  } else if ((!judged_.count(named) && judged_.size() < std::size_t{kVerdicts}) || again_.erase(named) > 0) {
    watches_.assign(1, Watch{named});
    for (const std::string& other : others)
      if (watches_.size() <= kCompanions && other != named && !beside_judged_.count({other, named}))
        watches_.push_back(Watch{other});
    left_ = kWatchSteps;
  } else {
    count_down();
  }
  return ended;
}

void EntryWatches::count_down() {
  if (!watches_.empty() && --left_ <= 0) watches_.clear();
}

}  // namespace ampdiag::agent
