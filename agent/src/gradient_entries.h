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
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

namespace ampdiag::agent {

class GradientEntries {
 public:
  static constexpr int kVerdicts = 4;
  static constexpr int kWatchSteps = 64;

  // Module `path`'s probed output `y` in a training forward: the first call of the step of
  // the module watched gets a hook on the gradient that reaches it.
  void output(const std::string& path, const at::Tensor& y);
  // As a host step ends. `named`: the module its first NaN/Inf gradient names, "" where it
  // was not skipped with a finite loss after a finite forward. Returns the detail of the
  // event to write ("PATH: nonfinite"), empty where none.
  std::string step_ended(const std::string& named);

 private:
  void count_down();

  std::string watched_;
  int left_ = 0;
  bool hooked_ = false;
  // -1: no gradient seen this step; 0: finite; 1: NaN/Inf (set by autograd, maybe on another thread).
  std::shared_ptr<std::atomic<int>> reached_ = std::make_shared<std::atomic<int>>(-1);
  std::set<std::string> judged_;
};

}  // namespace ampdiag::agent
