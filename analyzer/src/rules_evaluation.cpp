// evaluation-overflow: an evaluation between the training steps (a validation pass, the
// model in eval mode under no_grad or inference_mode) whose output went NaN/Inf. The steps
// record nothing of it, and every training step may be finite while each validation loss is
// NaN: fp16 overflows there on what training never met (longer sequences, other data). The
// Python agent checks such a forward's output, and once one went NaN/Inf, each module's
// output in the evaluations after it (event evaluation-output-nonfinite: the first module,
// "" for the model's own forward(), "(not looked at)" where no evaluation followed).
#include <string>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

constexpr const char* kKind = "evaluation-output-nonfinite";
constexpr const char* kNotLookedAt = "(not looked at)";

// Whether training's FP32 replay of `module` made NaN/Inf from finite inputs: the module
// makes them by design, in evaluation as in training.
bool made_by_design(const Run& run, const std::string& module) {
  for (const auto& r : run.replays)
    if (r.module == module && r.outcome == "intrinsic") return true;
  return false;
}

}  // namespace

void evaluation_overflow(const Run& run, std::vector<Finding>& out) {
  std::vector<std::int64_t> steps;
  const rundb::EventRow* looked = nullptr;  // the first evaluation whose modules were looked at
  for (const auto& e : run.events) {
    if (e.kind != kKind) continue;
    steps.push_back(e.step);
    if (!looked && e.detail != kNotLookedAt) looked = &e;
  }
  if (steps.empty()) return;
  Finding f;
  f.rule = "evaluation-overflow";
  f.severity = Severity::kWarning;
  f.score = 9.0;
  f.steps = steps;
  const std::string where = "in " + plural(std::int64_t(steps.size()), "evaluation") + " between the training steps " +
                            "(the model in eval mode, gradients off; at step" + (steps.size() == 1 ? " " : "s ") +
                            step_list(steps) + ")";
  if (!looked) {
    f.title = "An evaluation's output went NaN/Inf between the training steps: its results are NaN/Inf";
    f.evidence = "the model's output held NaN/Inf " + where +
                 "; no evaluation followed it, so no module's output was looked at: evaluate again with ampdiag "
                 "attached to name the first module";
  } else if (made_by_design(run, looked->detail)) {
    const std::string place = looked->detail.empty() ? "the model's own forward()" : looked->detail;
    f.module = looked->detail;
    f.severity = Severity::kInfo;
    f.title = "Evaluations between the training steps went NaN/Inf in " + place +
              ", which makes NaN/Inf by design: not fp16's";
    f.evidence = "the model's output held NaN/Inf " + where + ", first in " + place +
                 ", whose training replay in FP32 made NaN/Inf from finite inputs too (a -inf mask, an all-masked "
                 "softmax row)";
    out.push_back(f);
    return;
  } else if (looked->detail.empty()) {
    f.title = "Evaluations between the training steps went NaN/Inf in the model's own forward(): every module's "
              "output was finite";
    f.evidence = "the model's output held NaN/Inf " + where + ", while every watched module's output was finite";
  } else {
    f.module = looked->detail;
    // "first at 0" read as a step where the module is an nn.Sequential's index: its type says what it is.
    const ModuleSummary* m = run.module_named(f.module);
    const std::string type = m && !m->info.module_type.empty() ? " (" + m->info.module_type + ")" : "";
    f.title = "Evaluations between the training steps went NaN/Inf, first in module " + f.module + type;
    f.evidence = "the model's output held NaN/Inf " + where + "; the first module whose output held NaN/Inf was " +
                 f.module + " (at step " + std::to_string(looked->step) +
                 ": each module is looked at once an evaluation's output went NaN/Inf)";
    Suggestion pin = suggest::pin_fp32(run, f.module);
    pin.summary = "Run " + f.module + " in FP32, in evaluation and training alike: autocast off around it, its "
                  "floating-point inputs cast to float32 (not replayed: an evaluation's forward is not re-run).";
    pin.untried = true;
    f.suggestions.push_back(pin);
  }
  const std::string device = suggest::device_type(run);
  f.suggestions.push_back(
      {"Or evaluate without fp16: the validation loop's autocast off (FP32), or in bfloat16 where the hardware has it.",
       "model.eval()\n"
       "with torch.no_grad(), torch.autocast(device_type=\"" + device + "\", dtype=torch.bfloat16):\n"
       "    out = model(x)",
       "",
       ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
