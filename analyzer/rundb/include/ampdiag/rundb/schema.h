// The run.db format version and identity. docs/FORMAT.md is the full description.
#pragma once

#include <cstdint>

namespace ampdiag::rundb {

// Bumped on any change a reader of the previous version would misread.
// 3: gpu_time (the profiler's device time per step, module, phase and precision).
// 4: weight_updates (updates that rounded away in half-precision parameters).
constexpr int kSchemaVersion = 4;
// PRAGMA application_id of every run.db: "AMPD".
constexpr std::int32_t kApplicationId = 0x414d5044;

}  // namespace ampdiag::rundb
