#include "precision_checks.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "agent_setup.h"
#include "autocast_state.h"
#include "fp32_replay.h"
#include "session.h"
#include "tensor_views.h"

namespace ampdiag::agent {

PrecisionChecks::PrecisionChecks(Session& session, double budget) : session_(session), budget_(budget) {
  if (!(budget >= 0.0 && budget <= 1.0))
    throw std::invalid_argument("AgentOptions.precision_budget must be between 0 and 1 (a share of the training "
                                "time; 0: no precision checks), not " + std::to_string(budget));
}

void PrecisionChecks::step_began() {
  armed_.clear();
  input_ = at::Tensor();
  const auto now = Clock::now();
  if (!started_) {
    started_ = true;
    start_ = now;
  }
  const auto elapsed = ns_between(start_, now);
  if (rotation_.empty() || budget_ <= 0.0 || double(spent_ns_) > budget_ * double(elapsed)) return;
  armed_ = rotation_[next_++ % rotation_.size()];
}

bool PrecisionChecks::wants(const std::string& path, const at::Tensor& x) {
  if (budget_ <= 0.0) return false;
  if (!left_.count(path) && std::find(rotation_.begin(), rotation_.end(), path) == rotation_.end())
    rotation_.push_back(path);
  if (path != armed_ || !at::GradMode::is_enabled() || !x.defined() || !at::isFloatingType(x.scalar_type()))
    return false;
  if (!x.device().is_cpu()) {  // not compared here (see the header): its turns go to the others
    leave(path);
    return false;
  }
  armed_.clear();  // the module's first call of the step, or none
  // Only a call in reduced precision has something to compare.
  return half_precision(x.scalar_type()) ||
         (autocast_enabled(at::kCPU) && half_precision(autocast_dtype(at::kCPU)));
}

void PrecisionChecks::before(const at::Tensor& x) {
  const auto timed = spent_time();
  input_ = x.detach().clone();  // the call may change x in place
  rng_ = cpu_rng_state();
}

void PrecisionChecks::leave(const std::string& path) {
  left_.insert(path);
  rotation_.erase(std::remove(rotation_.begin(), rotation_.end(), path), rotation_.end());
  armed_.clear();
}

double PrecisionChecks::after(const std::string& path, const at::Tensor& y, const Forward& replay) {
  if (!input_.defined()) return -1.0;
  double recorded = -1.0;
  const auto timed = spent_time();
  const at::Tensor x = std::move(input_);
  input_ = at::Tensor();
  try {
    if (y.defined() && y.device().is_cpu() && at::isFloatingType(y.scalar_type()) && y.numel() > 0) {
      // x: before()'s copy, dropped after; rng_: the dropout masks the call drew
      const at::Tensor r = replay_in_fp32(replay, x, ReplayInput::kCallers, rng_);
      if (r.defined() && r.sizes() == y.sizes() && r.device() == y.device() && at::isFloatingType(r.scalar_type())) {
        const at::Tensor y32 = y.detach().to(at::kFloat), r32 = r.to(at::kFloat);
        // NaN/Inf has its own replay; norms in float64: a bf16 output's squares can pass float32's range
        if (at::isfinite(y32).all().item<bool>() && at::isfinite(r32).all().item<bool>()) {
          const double norm = at::linalg_vector_norm(r32, 2, c10::nullopt, false, at::kDouble).item<double>();
          const double diff = at::linalg_vector_norm(y32 - r32, 2, c10::nullopt, false, at::kDouble).item<double>();
          if (norm > 0.0 && std::isfinite(diff / norm)) {
            const std::int64_t zeroed = y32.eq(0).logical_and_(r32.ne(0)).sum().item<std::int64_t>();
            session_.precision_check(path, dtype_name(y.scalar_type()), y.numel(), diff / norm, zeroed,
                                     r32.abs().max().item<double>());
            recorded = diff / norm;
          }
        }
      }
    }
  } catch (const std::exception&) {
    leave(path);  // a check must never break the training
  }
  return recorded;
}

}  // namespace ampdiag::agent
