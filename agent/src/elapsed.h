// The agent's own time on the training thread: counted in the step's agent_ns and, for the
// precision checks, against their share of the wall time.
#pragma once

#include <chrono>
#include <cstdint>
#include <utility>

namespace ampdiag::agent {

using Clock = std::chrono::steady_clock;

inline std::int64_t ns_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
}

inline std::int64_t ns_since(Clock::time_point t0) { return ns_between(t0, Clock::now()); }

// Hands `add` the nanoseconds from its construction to the end of its scope, however the
// scope ends: an early return or torch's exception still counts against the agent.
template <typename Add>
class AddsElapsed {
 public:
  explicit AddsElapsed(Add add) : add_(std::move(add)) {}
  AddsElapsed(const AddsElapsed&) = delete;
  AddsElapsed& operator=(const AddsElapsed&) = delete;
  ~AddsElapsed() { add_(ns_since(t0_)); }

 private:
  Add add_;
  Clock::time_point t0_ = Clock::now();
};

}  // namespace ampdiag::agent
