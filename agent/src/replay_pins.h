// The C++ agent's FP32 replay and self-healing pins (AgentOptions::replay, ::autopin) for
// modules run through Agent::forward(): the Python agent's _replay.py and _autopin.py,
// without hooks (the user routes the module's forward through the agent).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "session.h"

namespace ampdiag::agent {

class ReplayPins {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;

  ReplayPins(Session& session, bool replay, std::int64_t autopin) : session_(session), replay_(replay), limit_(autopin) {}

  bool pinned(const std::string& path) const { return pinned_.count(path) != 0; }
  // The module's output held NaN/Inf and was the step's first such probe: runs `replay` on
  // an fp32 copy of x with autocast and autograd off and the CPU RNG restored after, once
  // per module and run; records the outcome, and a confirmed module is pinned when the
  // step ends (within the limit). Where it was finite, a host x holding finite values that
  // fp16 cannot hold under float16 autocast is event "input-beyond-fp16", as the Python
  // agent words it (`model_input`: x is the model's input, given to Agent::input()).
  // Returns the replay's outcome, as the event says it ("finite", "intrinsic": NaN/Inf from
  // finite x, "nonfinite": x held it, "unconfirmed"), or "" where the module was replayed before.
  std::string nonfinite_output(const std::string& path, const Forward& replay, const at::Tensor& x, bool model_input);
  // A precision check found `lost` (relative L2 error against FP32) of the module's finite
  // output: at kLost or more it is pinned when the step ends (within the limit), event
  // "autopin-precision".
  static constexpr double kLost = 0.5;
  void lossy_output(const std::string& path, double lost);
  // The step ended: what was confirmed in it is pinned from the next one on.
  void step_ended();
  // The next step began: one "autopin" event per module pinned from it on.
  void announce();

 private:
  Session& session_;
  bool replay_;
  std::int64_t limit_;
  std::set<std::string> replayed_, pinned_;
  std::vector<std::string> confirmed_, announce_;
  // Whether `path` may still be pinned: not already, and within the limit (else the event).
  bool may_pin(const std::string& path);
  void look_at_input_range(const std::string& path, const at::Tensor& x, bool model_input);
};

}  // namespace ampdiag::agent
