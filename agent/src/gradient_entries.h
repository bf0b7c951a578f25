// Where a backward overflow enters a module, as the Python agent's _gradient_entry.py: the
// first NaN/Inf gradient of a skipped step names the module whose backward ran first with
// it (Session::origin_module), yet that module may only have received the NaN/Inf through
// its output's gradient, made by the code after it (a gain in the model's forward(), whose
// fp16 backward overflows), where pinning the module alone is not the fix.
//
// So the module a skipped step names has the gradient reaching its output checked at its
// first probed call of each step after that (host tensors only: a device check would wait
// for the device), and the next skipped step that names it again gives the verdict: event
// "module-output-gradient", "PATH: nonfinite" or "PATH: finite". A skip naming another
// module moves the watch there; one verdict a module, at most kVerdicts a run, and a watch
// no skip answers within kWatchSteps steps is dropped.
//
// The other modules whose gradients went NaN/Inf in that skip (at most kCompanions) are
// watched with it, and judged at a later skip naming it where theirs went NaN/Inf again
// (the watch lasts until each is judged, or its kWatchSteps run out): event
// "companion-output-gradient", "q: finite, beside k" says q's own backward overflowed as
// well, apart from k's (two projections of one large input), so that pinning k alone would
// leave the step skipped; "nonfinite", that q received its NaN/Inf. A companion's verdict
// leaves its own as a named module to come (and the looks that follow that one).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace ampdiag::agent {

class GradientEntries {
 public:
  static constexpr int kVerdicts = 4;
  static constexpr int kWatchSteps = 64;
  static constexpr std::size_t kCompanions = 3;

  // Module `path`'s probed output `y` in a training forward: the first call of the step of
  // each module watched gets a hook on the gradient that reaches it.
  void output(const std::string& path, const at::Tensor& y);
  // As a host step ends. `named`: the module its first NaN/Inf gradient names, "" where it
  // was not skipped with a finite loss after a finite forward; `others`: the other modules
  // whose gradients went NaN/Inf in it (Session::nonfinite_modules()). Returns the events to
  // write, the named module's verdict first; none most steps.
  struct Event {
    std::string kind, detail;
  };
  static constexpr const char* kKind = "module-output-gradient";
  static constexpr const char* kBesideKind = "companion-output-gradient";
  std::vector<Event> step_ended(const std::string& named, const std::vector<std::string>& others);

 private:
  struct Watch {
    std::string path;
    bool hooked = false;
    bool done = false;  // judged
    // -1: no gradient seen this step; 0: finite; 1: NaN/Inf (set by autograd, maybe on another thread).
    std::shared_ptr<std::atomic<int>> reached = std::make_shared<std::atomic<int>>(-1);
  };
  void count_down();

  std::vector<Watch> watches_;  // the named module's first, then its companions
  int left_ = 0;
  int named_verdicts_ = 0;
  std::set<std::string> judged_;         // named modules' verdicts
  std::set<std::string> beside_judged_;  // companions' verdicts, "q beside k"
};

}  // namespace ampdiag::agent
