// The device profile's answers: where device time goes per module and in which precision,
// what ampdiag itself costs, and what pinning a module to FP32 would cost.
#pragma once

#include <string>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

DeviceProfile device_profile(const Run& run);

// What running `module` (and everything inside it) in FP32 would cost, estimated; empty when
// the run has no device time for it.
std::string pin_cost(const Run& run, const std::string& module);

// The factor assumed when the run has no FP32 kernels of a comparable module.
constexpr double kAssumedFp32Factor = 2.0;

}  // namespace ampdiag::analyzer
