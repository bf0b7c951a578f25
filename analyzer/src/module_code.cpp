// What a module's own code after its submodules says about a confirmed forward overflow.
#include "module_code.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

#include "loss_code.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// Operations that add up many terms of their input into one value each: a count of terms
// past 65504 / |term| overflows fp16 whatever the module's weights. (Not IndexPut or
// EmbeddingBag, whose names do not say whether they accumulate or average.)
constexpr std::array<const char*, 5> kSums = {"IndexAdd", "ScatterAdd", "ScatterReduce", "Sum", "Cumsum"};

bool sums(const std::string& op) {
  return std::find(kSums.begin(), kSums.end(), op) != kSums.end();
}

}  // namespace

std::string module_code_evidence(const Run& run, const std::string& module) {
  const loss_code::Code code = loss_code::after_module(run, module, "module-code");
  if (code.empty()) return "";
  return "; its own code after its submodules, read at step " + std::to_string(code.step) + ": " + code.describe();
}

std::optional<Suggestion> divide_the_sum(const Run& run, const std::string& module, double fp32_absmax) {
  if (!suggest::beyond_fp16(run, fp32_absmax)) return std::nullopt;
  const loss_code::Code code = loss_code::after_module(run, module, "module-code");
  const auto sum = std::find_if(code.ops.rbegin(), code.ops.rend(), [](const loss_code::Op& op) { return sums(op.name); });
  if (sum == code.ops.rend()) return std::nullopt;
  char reached[32];
  std::snprintf(reached, sizeof reached, "%.6g", fp32_absmax);  // as the replay's evidence quotes it
  Suggestion s;
  s.summary = "Divide the sum in " + module + "'s own code (" + sum->name + ") by its number of terms (a mean, or a "
              "degree normalisation as a graph convolution's): in FP32 " + module + "'s output reached " + reached +
              ", beyond fp16's " + std::to_string(std::lround(run.fp_max)) +
              ", which a sum over that many terms outgrows whatever the weights.";
  const std::string& op = sum->name;
  s.python = "# in " + module + "'s forward(): an average, not a sum\n" +
             (op == "Sum"      ? std::string("out = x.mean(dim)  # was x.sum(dim)")
              : op == "Cumsum" ? std::string("out = x.cumsum(dim) / torch.arange(1, x.shape[dim] + 1)  # a running mean")
                               : std::string("out = torch.zeros(n, d, dtype=m.dtype).index_add_(0, dst, m)\n"
                                             "out = out / deg.clamp(min=1).unsqueeze(1).to(out.dtype)  # deg: the "
                                             "terms each row summed"));
  s.untried = true;
  return s;
}

}  // namespace ampdiag::analyzer::rules
