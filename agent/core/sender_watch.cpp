#include "sender_watch.h"

#include <algorithm>

#include "ampdiag/rundb/module_paths.h"

namespace ampdiag::agent {

void SenderWatch::arm(const std::string& path) {
  if (judged_.count(path)) return;
  target_ = path;
  left_ = kWatchSteps;
}

bool SenderWatch::user(const std::string& path) const {
  return armed() && !path.empty() && !rundb::within(path, target_) && !rundb::within(target_, path);
}

std::string SenderWatch::step_ended(const std::string& named, const std::vector<Call>& calls) {
  if (!armed()) return "";
  if (named == target_ && !calls.empty()) {
    std::vector<const Call*> made;
    for (const Call& c : calls)
      if (c.received == 0 && c.sent >= 0) made.push_back(&c);
    // A block and the layer inside it that sent them both qualify: the layer is the one.
    std::vector<const Call*> inner;
    for (const Call* c : made)
      if (std::none_of(made.begin(), made.end(),
                       [&](const Call* o) { return o->path != c->path && rundb::within(o->path, c->path); }))
        inner.push_back(c);
    std::stable_sort(inner.begin(), inner.end(), [](const Call* a, const Call* b) { return a->sent < b->sent; });
    std::vector<std::string> names;
    for (const Call* c : inner)
      if (std::find(names.begin(), names.end(), c->path) == names.end()) names.push_back(c->path);
    std::string detail;
    for (const std::string& name : names) detail += (detail.empty() ? target_ + ": " : ", ") + name;
    judged_.insert(target_);
    target_.clear();
    return detail;
  }
  if (--left_ <= 0) target_.clear();
  return "";
}

}  // namespace ampdiag::agent
