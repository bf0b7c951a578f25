// The fixes for the code after a module that sends NaN/Inf back into it.
#include "code_after_fixes.h"

#include "loss_code.h"
#include "model_parameters.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// How the evidence and the fixes name the code after a module, by where the agent saw it
// run: the code, where to write the fix, and where it runs in the evidence's words.
struct CodeName {
  std::string code, where, runs;
};

CodeName code_name(const Run& run, const std::string& module) {
  switch (loss_code::place_after(run, module)) {
    case loss_code::Place::kModel:
      return {"the model's own code", "in the model's forward()", "the model's own forward() after it"};
    case loss_code::Place::kLoss:
      return {"the loss code", "where the loss is computed",
              "the loss, which takes " + module + "'s output as the model's"};
    case loss_code::Place::kModelThenLoss:
      return {"the model's own code and the loss code", "in the model's forward() and where the loss is computed",
              "the model's own forward() after it, then the loss"};
    case loss_code::Place::kUnknown: break;
  }
  return {"the code", "in the model's forward() or where the loss is computed",
          "the model's own forward() after it, or the loss"};
}

}  // namespace

std::string code_after_place(const Run& run, const std::string& module) { return code_name(run, module).runs; }

std::string code_after_evidence(const Run& run, const std::string& module) {
  const loss_code::Code code = loss_code::after_module(run, module, "output-code");
  if (code.empty()) return "";
  std::string text = "; that code, read at step " + std::to_string(code.step) + ": " + code.describe();
  const loss_code::Code origin = loss_code::after_module(run, module, "output-code-origin");
  if (!origin.empty()) {
    const loss_code::Op& made = origin.ops.back();
    text += "; at step " + std::to_string(origin.step) + " " + made.name + " (" + made.dtype + ") was the first of "
            "it whose backward sent NaN/Inf back from finite gradients";
    if (origin.ops.size() > 1) {
      loss_code::Code before = origin;
      before.ops.pop_back();
      text += ", after " + before.describe();
    }
  }
  const std::string own = loss_code::parameters_after(run, module);
  if (!own.empty()) text += "; it reads the model's own " + own;
  return text;
}

std::optional<Suggestion> bound_exp_parameter(const Run& run, const std::string& module) {
  return model_parameters::exp_factor_bound(module, loss_code::parameters_after(run, module));
}

std::optional<Suggestion> lower_constant(const Run& run, const std::string& module) {
  const loss_code::Code origin = loss_code::after_module(run, module, "output-code-origin");
  if (origin.empty()) return std::nullopt;
  // That operation a product by a constant of 256 or more (read before the backward freed it):
  // its backward multiplies the gradient by as much (a LoRA adapter's scaling alpha / r of
  // 50000 on lora_B's output), and where it is a setting, lowering it is the fix.
  // Not where the code reads a parameter of the model's own (CLIP's learnt temperature, one
  // value read through exp()): its bound is the fix (bound_exp_parameter).
  const loss_code::Op& op = origin.ops.back();
  if (op.gain() < 256.0 || (op.name != "Mul" && op.name != "Div") || !loss_code::parameters_after(run, module).empty())
    return std::nullopt;
  const CodeName name = code_name(run, module);
  Suggestion lower;
  lower.summary = "Bring down the constant " + name.code + " that uses " + module + "'s output " +
                  (op.name == "Div" ? "divides" : "multiplies") + " by: " + loss_code::enlarging_text(op, run.fp_max) +
                  ", and its backward multiplies the gradient it sends back into " + module + " by as much, which "
                  "made the NaN/Inf at step " + std::to_string(origin.step) + ". Where it is a setting (a LoRA "
                  "adapter's scaling alpha / r, a loss or output multiplier), lower it; where it is by design, the "
                  "fixes that follow apply.";
  lower.python = "# where " + name.code + " multiplies by the constant: a LoRA adapter's\n"
                 "self.scaling = alpha / r  # 1 or 2 is usual (PEFT: LoraConfig(r=8, lora_alpha=16))";
  lower.untried = true;
  return lower;
}

std::vector<Suggestion> code_after_fixes(const Run& run, const std::string& module, const std::string& code_after,
                                         bool pinned) {
  const loss_code::Code origin = loss_code::after_module(run, module, "output-code-origin");
  const std::string uses = "that uses " + module + "'s output";
  const CodeName name = code_name(run, module);
  Suggestion in_fp32 = suggest::fp32_model_code(run, uses, "", name.code, name.where);
  Suggestion pin = suggest::pin_fp32(run, module);
  pin.summary = "Run " + module + " in FP32 (pinned: its output, and the gradient it receives, become float32), so "
                "that the large gradient " + code_after + " sends back stays in FP32 on its way into it.";
  if (origin.empty()) {
    std::string& where = in_fp32.summary;
    where[0] = 'r';  // "Run ..." continues the sentence
    where = "Where that code runs a matmul or another operation that autocast puts in fp16 whatever its inputs, " +
            std::string(pinned ? "" : "also ") + where;
    if (pinned) return {in_fp32};
    return {pin, in_fp32};
  }
  const std::string made = origin.ops.back().name;
  const std::string half = origin.autocast_float16();
  std::vector<Suggestion> fixes;
  if (auto lower = lower_constant(run, module)) fixes.push_back(*lower);
  if (!half.empty()) {
    // Pinned, the module's float32 output still reaches that operation through one autocast
    // keeps in fp16 (CLIP's similarities' Mm before the temperature's Mul): tried, its
    // text_projection pinned still collapses the scale.
    in_fp32.summary = "Run " + name.code + " " + uses + " in FP32: " + made + "'s fp16 backward made the NaN/Inf" +
                      (half == made ? ", and autocast runs " + made
                                    : ", after " + half + ", which autocast runs") +
                      " in fp16 whatever the inputs' dtype, so pinning " + module + " alone leaves it in fp16; "
                      "autocast off around that code, its inputs cast to float32. Or move that code into a module, "
                      "which ampdiag then names and pin_fp32() pins.";
    fixes.push_back(in_fp32);
    return fixes;
  }
  // Between the module's output and that operation, only operations that keep their input's
  // dtype: pinned, its backward runs in float32 too (a VAE's gain and the KL's exp() of the
  // log-variance after its encoder).
  pin.summary += " " + made + "'s backward made them in fp16, and pinned, it follows " + module +
                 "'s float32 output.";
  in_fp32.summary = "Or run " + name.code + " " + uses + " in FP32: autocast off around it, its inputs cast to "
                    "float32.";
  if (!pinned) fixes.push_back(pin);
  fixes.push_back(in_fp32);
  return fixes;
}

}  // namespace ampdiag::analyzer::rules
