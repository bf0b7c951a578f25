// The code a module runs after its submodules, where its FP32 replay confirmed an fp16
// overflow (event "module-code", Python agent): a graph layer's sum over a hub's messages
// (`index_add_`) is the overflow itself, and fp16's range, not the module, is what a sum of
// that many terms outgrows; so is a coupling layer's exp() of an unbounded log-scale.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// "; its own code after its submodules, read at step 0: Index, IndexAdd (all float16)";
// empty where none was read.
std::string module_code_evidence(const Run& run, const std::string& module);

// Where the module's FP32 output passed fp16's range (`fp32_absmax`), the fixes its own code
// calls for, untried, each first: where it takes exp() (Exp, Exp2, Expm1), its argument
// bounded (a flow's coupling layer whose log-scale has no tanh: exp() grows the output
// without limit, and alone passes 65504 above 11.09 in fp16); where it sums (IndexAdd,
// ScatterAdd, ScatterReduce, Sum, Cumsum), the sum divided by its number of terms. The
// exponent comes before the sum: it grows faster than any count of terms. Where it
// multiplies by a constant of 256 or more (or divides by one of 1/256 or less) without which
// the output would have stayed within fp16's range, that constant brought down, first of
// all (a LoRA adapter whose scaling alpha / r is 50000).
std::vector<Suggestion> own_code_fixes(const Run& run, const std::string& module, double fp32_absmax);

// Where the module makes NaN/Inf from finite inputs in FP32 too (its replay `intrinsic`) and
// its own code takes exp(): the argument bounded, untried (exp() passes float32's range above
// 88.72, so one without a bound ends in Inf whatever the precision); none otherwise.
std::optional<Suggestion> bound_the_exponent_beyond_fp32(const Run& run, const std::string& module);

// Where the module makes NaN/Inf from finite inputs in FP32 too and its own code takes a
// reciprocal square root (Rsqrt, Pow(-0.5)), or a square root or norm it divides by, and
// nothing else there makes Inf or NaN from finite values (an exp, a log): that root kept off
// 0 by an eps, untried (a Llama RMSNorm with rms_norm_eps=0 on a padding token's zero
// embedding: rsqrt(0) is Inf, and 0 times it NaN); none otherwise.
std::optional<Suggestion> keep_the_root_off_zero(const Run& run, const std::string& module);

// The code that made the NaN/Inf input of `first_seen`, the first module to show it, which
// only received it (event "input-code", Python agent): "; the code that made dec.0's input,
// read at step 0: Mul, Exp, Mul, Add (all float16)"; empty where none was read.
std::string input_code_evidence(const Run& run, const std::string& first_seen);

// Where that code takes exp(): its argument bounded, and in FP32 where it ran in half
// precision, untried (a VAE's exp(0.5 * logvar) in its own forward()). `who` names the code
// ("the model's own forward()"), `where` places it ("between logvar and dec.0").
std::optional<Suggestion> exp_in_input_code(const Run& run, const std::string& first_seen, const std::string& who,
                                            const std::string& where);

// Where that code divides by a constant of 1/8 or less (a temperature) or multiplies by one
// of 8 or more in float16, and holds no operation that makes NaN/Inf in any precision (a log,
// a sqrt): the operand in FP32, untried (F.gumbel_softmax(logits, tau) with tau = 1e-4
// between an encoder and a codebook). `who` and `where` as for exp_in_input_code.
std::optional<Suggestion> enlarging_in_input_code(const Run& run, const std::string& first_seen, const std::string& who,
                                                  const std::string& where);

// Where that code runs in float16 an operation autocast keeps there whatever its inputs'
// dtype (a matmul: Bmm, Mm) and a module that finished before `first_seen` in forward made
// outputs above sqrt(65504), 256, the largest such named: a product of two of them passes
// 65504, where float32 holds it; the operation in FP32, untried (a recommender's feature
// interaction, bmm(feats, feats^T), over an embedding table 3000 times too large). `who`
// and `where` as for exp_in_input_code.
std::optional<Suggestion> matmul_in_input_code(const Run& run, const std::string& first_seen, const std::string& who,
                                               const std::string& where);

}  // namespace ampdiag::analyzer::rules
