#include "replay_pins.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>

#include "agent_setup.h"
#include "autocast_state.h"
#include "fp32_replay.h"

namespace ampdiag::agent {

namespace {

std::string first_line(const char* what) {
  std::string s(what ? what : "");
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

std::string ReplayPins::nonfinite_output(const std::string& path, const Forward& replay, const at::Tensor& x,
                                         bool model_input) {
  if (!replay_ || !replayed_.insert(path).second) return "";
  std::string outcome = "unconfirmed", reason;
  double absmax = std::numeric_limits<double>::quiet_NaN();
  try {
    const at::Tensor y = replay_in_fp32(replay, x);
    if (!y.defined() || !at::isFloatingType(y.scalar_type())) {
      reason = "the replay returned no floating-point tensor";
    } else if (at::isfinite(y).all().item<bool>()) {
      outcome = "finite";
      absmax = y.numel() ? y.abs().max().item<double>() : 0.0;
    } else {
      // From finite inputs it makes NaN/Inf in any precision (a -inf mask, or a bug).
      outcome = at::isfinite(x).all().item<bool>() ? "intrinsic" : "nonfinite";
    }
  } catch (const std::exception& e) {
    reason = "the FP32 replay raised: " + first_line(e.what());
  }
  session_.replay(path, outcome, absmax, reason);
  if (outcome == "finite") look_at_input_range(path, x, model_input);
  if (outcome == "finite" && may_pin(path)) confirmed_.push_back(path);
  return outcome;
}

// Autocast casts x to fp16 for the module's fp16 operations, and fp16 rounds |x| >= 65520
// (halfway above its largest value, 65504) to Inf: the module received Inf it did not make.
// Host tensors only: a device count would wait for the device.
void ReplayPins::look_at_input_range(const std::string& path, const at::Tensor& x, bool model_input) {
  constexpr double kRoundsToInf = 65520.0;
  if (!x.defined() || !x.device().is_cpu() || x.layout() != at::kStrided || !at::isFloatingType(x.scalar_type()) ||
      x.scalar_type() == at::kHalf)
    return;
  if (!autocast_enabled(x.device().type()) || autocast_dtype(x.device().type()) != at::kHalf)
    return;
  c10::NoGradGuard no_grad;
  const at::Tensor magnitude = x.detach().abs();
  const at::Tensor beyond = at::isfinite(magnitude).logical_and(magnitude.ge(kRoundsToInf));
  const std::int64_t count = beyond.sum().item<std::int64_t>();
  if (count == 0) return;
  // One negative fill (an attention mask's float32 lowest, -1e9) is added to scores, not data.
  const at::Tensor out_of_range = x.detach().masked_select(beyond);
  const double first = out_of_range[0].item<double>();
  if (count > 1 && first < 0 && out_of_range.eq(first).all().item<bool>()) return;
  char values[96];
  std::snprintf(values, sizeof values, " values at or beyond %g, max |x| %g", kRoundsToInf,
                magnitude.masked_select(beyond).max().item<double>());
  session_.event("input-beyond-fp16", path + ": input (" + dtype_name(x.scalar_type()) + " " + c10::str(x.sizes()) +
                                          "): " + std::to_string(count) + " of " + std::to_string(x.numel()) + values +
                                          (model_input ? "; the model's input" : ""));
}

void ReplayPins::lossy_output(const std::string& path, double lost) {
  if (!(lost >= kLost) || !may_pin(path)) return;
  char percent[32];
  std::snprintf(percent, sizeof percent, "%.0f", lost * 100);
  session_.event("autopin-precision", path + ": " + percent + " % away from FP32");
  confirmed_.push_back(path);
}

bool ReplayPins::may_pin(const std::string& path) {
  if (limit_ <= 0 || pinned_.count(path) || std::find(confirmed_.begin(), confirmed_.end(), path) != confirmed_.end())
    return false;
  if (std::int64_t(pinned_.size() + confirmed_.size()) < limit_) return true;
  session_.event_once("autopin-limit", "autopin-limit",
                      path + " was confirmed too, but autopin=" + std::to_string(limit_) +
                          " modules are pinned already; pin it in code if the report names it");
  return false;
}

void ReplayPins::step_ended() {
  for (auto& path : confirmed_) {
    pinned_.insert(path);
    announce_.push_back(std::move(path));
  }
  confirmed_.clear();
}

void ReplayPins::announce() {
  for (const auto& path : announce_) session_.event("autopin", path);
  announce_.clear();
}

}  // namespace ampdiag::agent
