// The fixes for NaN/Inf gradients that reach a module through its output where no module
// given that output sent them: the code after it in forward (the model's own forward(), the
// loss) made them, and what the Python agent read of that code (loss_code::after_module)
// says whether pinning the module can keep the gradient in FP32 all the way into it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// "; that code, read at step 1: Div (float16), Mm (float16), ...; at step 2 Mul (float16)
// was the first of it whose backward sent NaN/Inf back from finite gradients, after ...; it
// reads the model's own logit_scale: 11.5 (float32, 1 value), read by Exp"; empty where the
// agent read none.
std::string code_after_evidence(const Run& run, const std::string& module);

// Where the code after `module` runs, in words for the evidence: "the model's own forward()
// after it", "the loss, ...", both, or, where the agent did not say, either.
std::string code_after_place(const Run& run, const std::string& module);

// The fixes, first first. `code_after` names that code ("the code that uses X's output");
// `pinned`: the module already ran in FP32. Where the agent traced the operation whose
// backward made the NaN/Inf (event "output-code-origin") and an operation autocast runs in
// fp16 whatever its inputs' dtype (a matmul) lies between the module's output and it, or is
// it, only the code in FP32: the module's pin does not reach it. Where none does, the pin
// first. Where none was traced, the pin, and the code in FP32 where it runs such an
// operation.
std::vector<Suggestion> code_after_fixes(const Run& run, const std::string& module, const std::string& code_after,
                                         bool pinned);

// Where the operation whose backward made the NaN/Inf (event "output-code-origin") is a product
// by a constant of 256 or more, or a division by its inverse, and the code reads no parameter
// of the model's own: lowering that constant (a LoRA adapter's scaling), untried.
std::optional<Suggestion> lower_constant(const Run& run, const std::string& module);

// Where that code reads one of the model's own parameters through exp() to a factor above
// CLIP's bound of 100 (event "output-parameters": a learnt temperature grown too large, or
// set so): its clamp, the parameter named.
std::optional<Suggestion> bound_exp_parameter(const Run& run, const std::string& module);

}  // namespace ampdiag::analyzer::rules
