// Where a backward overflow enters a module: the decisions both agents share (the C++
// agent's gradient_entries.h and the Python agent's _gradient_entry.py hook the tensors and
// report what they saw; nothing here knows torch).
//
// The first NaN/Inf gradient of a skipped step names the module whose backward ran first
// with it (Session::origin_module), yet that module may only have received the NaN/Inf
// through its output's gradient, made by the code after it (a gain in the model's forward(),
// whose fp16 backward overflows), where pinning the module alone is not the fix. So the
// module a skipped step names is watched: the agent checks the gradient reaching its output
// in each step after that, at the call that receives its gradient first in backward (the
// last call of a module the forward runs several times: the others' gradients may hold what
// its own backward made in between), and the next skipped step that names it again
// gives the verdict: event "module-output-gradient", "PATH: nonfinite" or "PATH: finite". A
// skip naming another module moves the watch there; one verdict a module, at most kVerdicts a
// run, and a watch no skip answers within kWatchSteps steps is dropped. A module judged
// "finite" is watched once more from a later skip naming it, and judged again: a run's first
// skips (the scaler's calibration) may overflow in the module's own backward and its later
// ones through its output (a Gaussian likelihood's exp() of a log-variance head, whose
// gradient passes 65504 once the variance is small).
//
// The other modules whose gradients went NaN/Inf in that skip (at most kCompanions) are
// watched with it, and judged at a later skip naming it where theirs went NaN/Inf again (the
// watch lasts until each is judged, or its kWatchSteps run out): event
// "companion-output-gradient", "q: finite, beside k" says q's own backward overflowed as
// well, apart from k's (two projections of one large input), so that pinning k alone would
// leave the step skipped; "nonfinite", that q received its NaN/Inf. A companion's verdict
// leaves its own as a named module to come (and the looks that follow that one).
#pragma once

#include <cstddef>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ampdiag::agent {

class EntryWatches {
 public:
  static constexpr int kVerdicts = 4;
  static constexpr int kWatchSteps = 64;
  static constexpr std::size_t kCompanions = 3;
  static constexpr const char* kKind = "module-output-gradient";
  static constexpr const char* kBesideKind = "companion-output-gradient";

  // What the agent saw of the gradient reaching a watched module's output this step.
  enum Reached : int { kNotSeen = -1, kFinite = 0, kNonfinite = 1 };

  struct Watch {
    std::string path;
    bool done = false;  // judged: its output needs no more looks
  };
  struct Event {
    std::string kind, detail;
  };
  struct Ended {
    std::vector<Event> events;  // the named module's verdict first; none most steps
    std::string nonfinite;      // the named module judged "nonfinite" now ("" if none): where its sender is next
  };

  // The watched modules, the named one first, then its companions; empty while none is.
  // The agent hooks the output of each one not done, and reports in this order.
  const std::vector<Watch>& watches() const { return watches_; }
  bool armed() const { return !watches_.empty(); }

  // As a host step ends. `named`: the module its first NaN/Inf gradient names, "" where it
  // was not skipped with a finite loss after a finite forward; `others`: the other modules
  // whose gradients went NaN/Inf in it (Session::nonfinite_modules(kCompanions)); `reached`:
  // per entry of watches() as the step ran, what reached its output (missing entries: not
  // seen). May re-arm watches() for other modules.
  Ended step_ended(const std::string& named, const std::vector<std::string>& others, const std::vector<int>& reached);

 private:
  void count_down();

  std::vector<Watch> watches_;
  int left_ = 0;
  std::set<std::string> judged_;                                // named modules' verdicts
  std::set<std::string> again_;                                 // judged "finite" once: to watch once more
  std::set<std::pair<std::string, std::string>> beside_judged_;  // companions' verdicts: (q, k)
};

}  // namespace ampdiag::agent
