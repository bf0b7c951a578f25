// The C++ agent's precision checks, as the Python agent's _precision.py, for the modules run
// through Agent::forward(): within a share of the training time (AgentOptions::
// precision_budget), one module at a time, round robin, is run once more in FP32 on a copy
// of its input with the RNG as the call drew it, and the two outputs are compared (a row of
// precision_checks: relative L2 error, values zeroed, FP32's abs-max; rule precision-loss).
// Host outputs only: comparing a device output would read it back on the training thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "elapsed.h"

namespace ampdiag::agent {

class Session;

class PrecisionChecks {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;

  // budget: the checks' share of the wall time since the first step began, 0..1 (0: none).
  PrecisionChecks(Session& session, double budget);

  // A step's cycle began: the next module in the rotation is armed if the checks so far are
  // within the budget.
  void step_began();
  // Module `path` is about to run on x in a training step: whether to keep what a check needs
  // (its first call of the step, when armed and in reduced precision). Adds the path to the
  // rotation the first time.
  bool wants(const std::string& path, const at::Tensor& x);
  // Before the call that wants() chose: the input and the RNG as the call finds them.
  void before(const at::Tensor& x);
  // After it: `replay` (the module's forward on a copy) runs in FP32 on the kept input, and
  // its output is compared with y. Returns the relative error recorded, or -1 for none.
  double after(const std::string& path, const at::Tensor& y, const Forward& replay);

 private:
  // The module leaves the rotation for good (a device input, or a check that failed).
  void leave(const std::string& path);

  struct AddToSpent {
    std::int64_t* spent_ns;
    void operator()(std::int64_t ns) const { *spent_ns += ns; }
  };
  // The checks' time, held against the budget when it goes.
  AddsElapsed<AddToSpent> spent_time() { return AddsElapsed<AddToSpent>(AddToSpent{&spent_ns_}); }

  Session& session_;
  double budget_;
  std::vector<std::string> rotation_;
  std::set<std::string> left_;
  std::size_t next_ = 0;
  std::string armed_;  // empty: none this step
  bool started_ = false;
  Clock::time_point start_;
  std::int64_t spent_ns_ = 0;
  at::Tensor input_, rng_;
};

}  // namespace ampdiag::agent
