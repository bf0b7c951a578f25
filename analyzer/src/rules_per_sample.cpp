// per-sample-gradients: Opacus's DP-SGD under a GradScaler. Its DPOptimizer clips, sums and
// noises each sample's gradient (p.grad_sample, of the loss backward() was given) into .grad
// inside step(), after the scaler has unscaled .grad and checked it: the scaler neither
// unscales nor checks the per-sample gradients. max_grad_norm then bounds them times the
// scale (at 65536 every sample is clipped), and one that overflows float16 (each is the batch
// size times a sample's share of a mean loss) makes an update NaN/Inf that the scaler applies:
// a Conv-GroupNorm classifier's head went NaN at its first step. The Python agent's events
// per-sample-gradients (once) and per-sample-nonfinite (the steps they held NaN/Inf).
#include <algorithm>
#include <string>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

const rundb::EventRow* applied_per_sample_nonfinite(const Run& run) {
  if (!run.has_scaler()) return nullptr;
  for (const auto& e : run.events) {
    if (e.kind != "per-sample-nonfinite") continue;
    const StepSummary* s = run.step_summary(e.step);
    if (s != nullptr && !s->row.skipped) return &e;
  }
  return nullptr;
}

Suggestion per_sample_fix(const Run& run) {
  const std::string device = suggest::device_type(run);
  return {"Train the DP-SGD loop without a GradScaler, under bfloat16 autocast: Opacus clips and sums the per-sample "
          "gradients itself, and bfloat16 keeps float32's range, so nothing needs scaling (or train in FP32).",
          "with torch.autocast(device_type=\"" + device + "\", dtype=torch.bfloat16):\n"
          "    loss = criterion(model(x), y)\n"
          "loss.backward()\n"
          "optimizer.step()  # the DPOptimizer, with no GradScaler\n"
          "optimizer.zero_grad()",
          "", ""};
}

void per_sample_gradients(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* held = run.first_event("per-sample-gradients");
  if (held == nullptr || !run.has_scaler() || run.steps.empty()) return;
  double low = run.steps.front().row.scale_before, high = low;
  for (const auto& s : run.steps) {
    low = std::min(low, s.row.scale_before);
    high = std::max(high, s.row.scale_before);
  }
  Finding f;
  f.rule = "per-sample-gradients";
  f.severity = Severity::kWarning;
  f.score = 45.0;
  f.steps = {held->step};
  f.title = "The DP optimizer clips and sums per-sample gradients of the scaled loss, which the GradScaler neither "
            "unscales nor checks";
  f.evidence = held->detail + "; at " +
               (low == high ? "a loss scale of " + fmt(low) : "loss scales from " + fmt(low) + " to " + fmt(high)) +
               " its max_grad_norm bounds them times the scale, not the gradients it was chosen for";
  if (const rundb::EventRow* bad = applied_per_sample_nonfinite(run)) {
    f.severity = Severity::kError;
    f.score = 94.0;  // above the NaN/Inf update it makes (nonfinite-update, 92)
    f.steps = {bad->step};
    f.evidence += "; at step " + std::to_string(bad->step) + " " + bad->detail +
                  " while .grad was finite, so the scaler applied the step and its update was made from them";
  }
  f.suggestions.push_back(per_sample_fix(run));
  out.push_back(std::move(f));
}

}  // namespace ampdiag::analyzer::rules
