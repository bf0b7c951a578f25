// The step's batch as the C++ agent sees it (Agent::input()): looked at once the step's
// first probe holds NaN/Inf, so that a bad batch is blamed on the data, not on the module
// that showed it first. The Python agent's look at the model's arguments (_looks.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "session.h"

namespace ampdiag::agent {

class BatchLooks {
 public:
  using Named = std::pair<std::string, at::Tensor>;

  explicit BatchLooks(Session& session) : session_(session) {}

  // A tensor given to input() in this step.
  void add(const std::string& name, const at::Tensor& x) { inputs_.emplace_back(name, x.detach()); }
  // Once a step, at its first NaN/Inf probe: event "input-nan" for the first host input
  // holding NaN, else for one holding Inf that `module_input` (what forward() gave the
  // module; null for a probe) views: a -inf mask passed in and only probed is by design.
  // Returns whether it was written.
  bool nonfinite(const at::Tensor* module_input);
  // The tensor given to input() in this step whose memory x views; null where none is.
  const Named* viewed_by(const at::Tensor& x) const;
  void step_began() {
    inputs_.clear();
    looked_.clear();
  }

 private:
  Session& session_;
  // Given this step, not yet looked at; and those looked at, kept for viewed_by().
  std::vector<Named> inputs_, looked_;
};

}  // namespace ampdiag::agent
