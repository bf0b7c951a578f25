// The agent's own time on the training thread: counted in the step's agent_ns and, for the
// precision checks, against their share of the wall time.
#pragma once

#include <chrono>
#include <cstdint>

namespace ampdiag::agent {

using Clock = std::chrono::steady_clock;

inline std::int64_t ns_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count();
}

inline std::int64_t ns_since(Clock::time_point t0) { return ns_between(t0, Clock::now()); }

}  // namespace ampdiag::agent
