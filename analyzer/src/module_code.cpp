// What a module's own code after its submodules, and the code that made the input of one that
// only received NaN/Inf, say about a forward NaN/Inf.
#include "module_code.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>

#include "loss_code.h"
#include "rules.h"
#include "suggestions.h"
#include "true_gradients.h"

namespace ampdiag::analyzer::rules {

namespace {

// "; <what>, read at step N: Op, Op (all float16)" for the code event `kind` about `module`;
// empty where none was read.
std::string code_evidence(const Run& run, const std::string& module, const char* kind, const std::string& what) {
  const loss_code::Code code = loss_code::after_module(run, module, kind);
  if (code.empty()) return "";
  return "; " + what + ", read at step " + std::to_string(code.step) + ": " + code.describe();
}

Suggestion divide_the_sum(const Run& run, const std::string& module, const std::string& op, double fp32_absmax) {
  Suggestion s;
  s.summary = "Divide the sum in " + module + "'s own code (" + op + ") by its number of terms (a mean, or a "
              "degree normalisation as a graph convolution's): in FP32 " + module + "'s output reached " +
              replay_absmax(fp32_absmax) + ", beyond fp16's " + std::to_string(std::lround(run.fp_max)) +
              ", which a sum over that many terms outgrows whatever the weights.";
  s.python = "# in " + module + "'s forward(): an average, not a sum\n" +
             (op == "Sum"      ? std::string("out = x.mean(dim)  # was x.sum(dim)")
              : op == "Cumsum" ? std::string("out = x.cumsum(dim) / torch.arange(1, x.shape[dim] + 1)  # a running mean")
                               : std::string("out = torch.zeros(n, d, dtype=m.dtype).index_add_(0, dst, m)\n"
                                             "out = out / deg.clamp(min=1).unsqueeze(1).to(out.dtype)  # deg: the "
                                             "terms each row summed"));
  s.cpp = "// in " + module + "'s forward(): an average, not a sum\n" +
          (op == "Sum"      ? std::string("auto out = x.mean(dim);  // was x.sum(dim)")
           : op == "Cumsum" ? std::string("auto out = x.cumsum(dim) / torch::arange(1, x.size(dim) + 1);  // a running mean")
                            : std::string("out = out / deg.clamp_min(1).unsqueeze(1).to(out.scalar_type());  // deg: the "
                                          "terms each row summed"));
  s.untried = true;
  return s;
}

// "Bound what M's own code passes to exp() (Exp): <why>. Squash it first, ...", with a snippet.
Suggestion bound_the_exponent(const std::string& module, const std::string& op, const std::string& why) {
  Suggestion s;
  s.summary = "Bound what " + module + "'s own code passes to exp() (" + op + "): " + why +
              ". Squash it first, as a flow's coupling layer squashes its log-scale with tanh.";
  s.python = "# in " + module + "'s forward(): exp() of a bounded value\n"
             "s = torch.tanh(s)  # or s.clamp(max=c); a learnt range: s = scale * torch.tanh(s / scale)\n"
             "y = x * torch.exp(s)";
  s.cpp = "// in " + module + "'s forward(): exp() of a bounded value\n"
          "s = torch::tanh(s);  // or s.clamp_max(c)\n"
          "auto y = x * torch::exp(s);";
  s.untried = true;
  return s;
}

// "Bring down the constant M's own code multiplies by ...": its FP32 output without it would
// have fit fp16.
Suggestion shrink_the_factor(const Run& run, const std::string& module, const loss_code::Op& op, double fp32_absmax) {
  char without[32];
  std::snprintf(without, sizeof without, "%.3g", fp32_absmax / op.gain());
  Suggestion s;
  s.summary = "Bring down the constant " + module + "'s own code " + (op.name == "Div" ? "divides" : "multiplies") +
              " by: " + loss_code::enlarging_text(op, run.fp_max) + ", and in FP32 " + module + "'s output reached " +
              replay_absmax(fp32_absmax) + ", which without it would be about " + without +
              ". Where it is a setting (a LoRA adapter's scaling alpha / r, a loss or output multiplier), lower it; "
              "where it is by design, the fixes that follow apply.";
  s.python = "# in " + module + "'s forward(), where it multiplies by the constant: a LoRA adapter's\n"
             "self.scaling = alpha / r  # 1 or 2 is usual (PEFT: LoraConfig(r=8, lora_alpha=16))";
  s.cpp = "// in " + module + "'s forward(), where it multiplies by the constant\n"
          "scaling = alpha / r;  // 1 or 2 is usual";
  s.untried = true;
  return s;
}

const char* const kExps[] = {"Exp", "Exp2", "Expm1"};

// The last operation of `code` for which `keep` holds; null where none does.
template <typename Keep>
const loss_code::Op* last_where(const loss_code::Code& code, Keep keep) {
  const auto op = std::find_if(code.ops.rbegin(), code.ops.rend(), keep);
  return op == code.ops.rend() ? nullptr : &*op;
}

// The last operation of `code` that `names` holds; null where none does.
template <typename Names>
const loss_code::Op* last_of(const loss_code::Code& code, const Names& names) {
  return last_where(code, [&](const loss_code::Op& o) {
    return std::any_of(std::begin(names), std::end(names), [&](const char* name) { return o.name == name; });
  });
}

}  // namespace

std::string module_code_evidence(const Run& run, const std::string& module) {
  return code_evidence(run, module, "module-code", "its own code after its submodules");
}

std::vector<Suggestion> own_code_fixes(const Run& run, const std::string& module, double fp32_absmax) {
  std::vector<Suggestion> fixes;
  if (!suggest::beyond_fp16(run, fp32_absmax)) return fixes;
  const loss_code::Code code = loss_code::after_module(run, module, "module-code");
  // A factor that alone takes the output past fp16's range: a setting more likely than a
  // design (a factor of design, sqrt(d_model), is smaller), so the first fix.
  constexpr double kLargeGain = 256.0;  // above sqrt(d_model) for any width in use
  if (const loss_code::Op* factor = last_where(code, [&](const loss_code::Op& op) {
        return op.gain() >= kLargeGain && fp32_absmax / op.gain() <= run.fp_max;
      }))
    fixes.push_back(shrink_the_factor(run, module, *factor, fp32_absmax));
  if (const loss_code::Op* exp = last_of(code, kExps))
    fixes.push_back(bound_the_exponent(module, exp->name,
                                       "in FP32 " + module + "'s output reached " + replay_absmax(fp32_absmax) +
                                           ", beyond fp16's " + std::to_string(std::lround(run.fp_max)) +
                                           ", and an exponent without a bound grows it without limit (in fp16 exp() "
                                           "alone passes 65504 above 11.09)"));
  // Operations that add up many terms of their input into one value each: a count of terms
  // past 65504 / |term| overflows fp16 whatever the module's weights. (Not IndexPut or
  // EmbeddingBag, whose names do not say whether they accumulate or average.)
  static const char* const kSums[] = {"IndexAdd", "ScatterAdd", "ScatterReduce", "Sum", "Cumsum"};
  if (const loss_code::Op* sum = last_of(code, kSums)) fixes.push_back(divide_the_sum(run, module, sum->name, fp32_absmax));
  return fixes;
}

std::optional<Suggestion> bound_the_exponent_beyond_fp32(const Run& run, const std::string& module) {
  const loss_code::Code code = loss_code::after_module(run, module, "module-code");
  const loss_code::Op* exp = last_of(code, kExps);
  if (!exp) return std::nullopt;
  return bound_the_exponent(module, exp->name,
                            "from finite inputs " + module + "'s output holds NaN/Inf in FP32 too, and exp() passes "
                            "float32's range above 88.72 (fp16's above 11.09), so an argument without a bound ends in "
                            "Inf whatever the precision");
}

std::optional<Suggestion> keep_the_root_off_zero(const Run& run, const std::string& module) {
  const loss_code::Code code = loss_code::after_module(run, module, "module-code");
  static const char* const kRoots[] = {"Rsqrt", "Pow(-0.5)"};
  static const char* const kSqrts[] = {"Sqrt", "Norm", "LinalgVectorNorm"};
  static const char* const kDivides[] = {"Div", "Reciprocal"};
  static const char* const kOthers[] = {"Exp", "Exp2", "Expm1", "Log", "Log1p", "Log2", "Log10"};
  // Another operation that makes Inf or NaN from finite values leaves the root unproven.
  if (last_of(code, kOthers)) return std::nullopt;
  const loss_code::Op* root = last_of(code, kRoots);
  const bool reciprocal = root != nullptr;
  // A square root or norm only where the code divides by a tensor (a constant divisor is no 0).
  if (!root && last_where(code, [](const loss_code::Op& o) {
        return o.constant == 0.0 && std::any_of(std::begin(kDivides), std::end(kDivides),
                                                [&](const char* name) { return o.name == name; });
      }))
    root = last_of(code, kSqrts);
  if (!root) return std::nullopt;
  Suggestion s;
  s.summary = "Keep what " + module + "'s own code " +
              (reciprocal ? "takes the reciprocal square root of (" + root->name + ")"
                          : "takes the square root or norm of and divides by (" + root->name + ")") +
              " off 0: there it is Inf in any precision, and a row of all zeros (a padding token's embedding, which "
              "padding_idx keeps at zero; a masked position) times it is NaN. Add an eps under the root, as RMSNorm "
              "and LayerNorm do (1e-6; an eps of 0 adds nothing), or clamp it (clamp_min(1e-12)).";
  s.python = "# in " + module + "'s forward(): an eps under the root\n"
             "variance = x.pow(2).mean(-1, keepdim=True)\n"
             "x = x * torch.rsqrt(variance + self.eps)  # self.eps > 0 (1e-6), not 0";
  s.cpp = "// in " + module + "'s forward(): an eps under the root\n"
          "auto variance = x.pow(2).mean(-1, /*keepdim=*/true);\n"
          "x = x * torch::rsqrt(variance + eps);  // eps > 0 (1e-6), not 0";
  s.untried = true;
  return s;
}

std::string input_code_evidence(const Run& run, const std::string& first_seen) {
  return code_evidence(run, first_seen, "input-code", "the code that made " + first_seen + "'s input");
}

std::optional<Suggestion> exp_in_input_code(const Run& run, const std::string& first_seen, const std::string& who,
                                            const std::string& where) {
  const loss_code::Code code = loss_code::after_module(run, first_seen, "input-code");
  const loss_code::Op* exp = last_of(code, kExps);
  if (!exp) return std::nullopt;
  const bool half = exp->dtype == "float16" || exp->dtype == "bfloat16";
  const bool fp16 = exp->dtype == "float16";
  Suggestion s;
  s.summary = "Bound what " + who + " passes to exp() " + where + " (" + exp->name + (exp->dtype == "?" ? "" : ", " + exp->dtype) +
              "): that code made the NaN/Inf " + first_seen + " received, and exp() passes " +
              (fp16 ? std::string("65504 above 11.09 in float16, float32's range above 88.72")
                    : std::string("float32's range above 88.72")) +
              (half ? ". Compute it in FP32, its argument clamped" : ". Clamp its argument") +
              " (a VAE's log-variance, whose exp(0.5 * logvar) grows without limit as logvar does).";
  s.python = half ? "y = torch.exp(x.float().clamp(max=20))  # was torch.exp(x): in FP32, its argument bounded"
                  : "y = torch.exp(x.clamp(max=80))  # was torch.exp(x): its argument bounded";
  s.cpp = half ? "auto y = torch::exp(x.to(torch::kFloat).clamp_max(20));  // was torch::exp(x): in FP32, bounded"
               : "auto y = torch::exp(x.clamp_max(80));  // was torch::exp(x): its argument bounded";
  s.untried = true;
  return s;
}

std::optional<Suggestion> enlarging_in_input_code(const Run& run, const std::string& first_seen, const std::string& who,
                                                  const std::string& where) {
  const loss_code::Code code = loss_code::after_module(run, first_seen, "input-code");
  const loss_code::Op* op = loss_code::float16_enlarging(code);
  // An operation that makes NaN from finite values in any precision (a log, a sqrt) is the
  // likelier cause there: no factor is blamed beside it. (exp() and cosh() only pass the
  // range, as the factor does: the exp()'s fix comes first, this one after it.)
  if (!op) return std::nullopt;
  for (const loss_code::Fix& known : loss_code::fixes(code, loss_code::Phase::kForward))
    if (!known.range) return std::nullopt;
  const bool div = op->name == "Div";
  Suggestion s;
  s.summary = "Compute in FP32 what " + who + " " + (div ? "divides" : "multiplies") + " " + where + ": in float16 " +
              loss_code::enlarging_text(*op, run.fp_max) + ", where float32 holds it; " + first_seen +
              " received NaN/Inf from that code. Cast the operand to float32 first, as for a temperature: "
              "F.gumbel_softmax(logits.float(), tau), (logits.float() / tau).softmax(-1).";
  s.python = div ? "y = x.float() / tau  # was x / tau in float16: x / tau passes 65504 where x is above 65504 * tau"
                 : "y = x.float() * c  # was x * c in float16: x * c passes 65504 where x is above 65504 / c";
  s.cpp = div ? "auto y = x.to(torch::kFloat) / tau;  // was x / tau in float16"
              : "auto y = x.to(torch::kFloat) * c;  // was x * c in float16";
  s.untried = true;
  return s;
}

std::optional<Suggestion> matmul_in_input_code(const Run& run, const std::string& first_seen, const std::string& who,
                                               const std::string& where) {
  const ModuleSummary* seen = run.module_named(first_seen);
  if (!run.fp16() || seen == nullptr || seen->position < 0) return std::nullopt;
  const loss_code::Code code = loss_code::after_module(run, first_seen, "input-code");
  const std::string matmuls = code.autocast_float16();
  if (matmuls.empty()) return std::nullopt;
  const double root = std::sqrt(run.fp_max);
  const ModuleSummary* large = nullptr;
  for (const auto& m : run.modules)
    if (!m.info.path.empty() && m.position >= 0 && m.position < seen->position && m.max_absmax > root &&
        (large == nullptr || m.max_absmax > large->max_absmax))
      large = &m;
  if (large == nullptr) return std::nullopt;
  // Its weights' scale where one of them is far from any standard initialisation's: torch
  // starts an embedding at RMS 1, a Linear below 1.
  std::string weights;
  for (const LayerSummary& layer : run.layers)
    if (layer.info.module_path == large->info.path && weight_named(layer.info.name))
      if (const double rms = mean_weight_rms(run, layer); rms >= 64.0)
        weights = " (" + layer.info.name + "'s RMS is " + three_digits(rms) + ", where torch initialises an embedding "
                  "at 1 and a Linear below 1)";
  // What takes the product in fp16 overflows next: the matmul in FP32 alone moves it on.
  const std::string taker = products_only_type(run, first_seen);
  const bool takes_half = !taker.empty() && taker.find("Embedding") == std::string::npos;
  Suggestion s;
  s.summary = "Bring " + large->info.path + "'s outputs down: they reach " + three_digits(large->max_absmax) +
              ", above " + fmt(std::round(root)) + ", and " + who + " multiplies them " + where + " in " + matmuls +
              ", which autocast runs in float16 whatever its inputs' dtype, where a product of two values above " +
              fmt(std::round(root)) + " passes " + fmt(run.fp_max) + "; " + first_seen +
              " received NaN/Inf from that code. Find why they are that large: its weights' scale" + weights +
              ", its input's. " +
              (takes_half ? "Computing the " + matmuls + " in FP32 alone would hand its product on to " + first_seen +
                                " (" + taker + "), which autocast runs in float16 too."
                          : "Or compute the " + matmuls + " in FP32, autocast off around it and its operands cast to "
                            "float32, where what takes its product holds it.");
  if (!takes_half) {
    const std::string device = suggest::cpp_device_type(run);
    s.python = "with torch.autocast(device_type=\"" + suggest::device_type(run) + "\", enabled=False):\n"
               "    y = a.float() @ b.float()  # was the " + matmuls + " of a and b under autocast, in float16";
    s.cpp = "at::autocast::set_autocast_enabled(" + device + ", false);\n"
            "auto y = a.to(torch::kFloat).matmul(b.to(torch::kFloat));  // was the " + matmuls + " in float16\n"
            "at::autocast::set_autocast_enabled(" + device + ", true);";
  }
  s.untried = true;
  return s;
}

}  // namespace ampdiag::analyzer::rules
