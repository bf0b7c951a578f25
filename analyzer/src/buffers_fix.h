// The fix for a module whose buffers hold NaN, or Inf that training wrote (event "buffers-nan").
#pragma once

#include <string>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// `buffers`: the event's list without the module's path ("codebook (float16: 7 of 2048 values
// Inf, finite at attach())"). A BatchNorm's NaN running statistics are reset, other NaN
// buffers restored; buffers a step wrote Inf into are updated in FP32 (the module's pin), and
// float16 ones stored in float32 first.
Suggestion buffers_fix(const Run& run, const std::string& path, const std::string& buffers);

}  // namespace ampdiag::analyzer::rules
