// The code a module runs after its submodules, where its FP32 replay confirmed an fp16
// overflow (event "module-code", Python agent): a graph layer's sum over a hub's messages
// (`index_add_`) is the overflow itself, and fp16's range, not the module, is what a sum of
// that many terms outgrows.
#pragma once

#include <optional>
#include <string>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// "; its own code after its submodules, read at step 0: Index, IndexAdd (all float16)";
// empty where none was read.
std::string module_code_evidence(const Run& run, const std::string& module);

// Where that code sums (IndexAdd, ScatterAdd, ScatterReduce, Sum, Cumsum) and the module's FP32 output
// passed fp16's range (`fp32_absmax`): the sum divided by its number of terms, untried.
std::optional<Suggestion> divide_the_sum(const Run& run, const std::string& module, double fp32_absmax);

}  // namespace ampdiag::analyzer::rules
