// nonfinite-update: an optimizer step that applied NaN/Inf gradients (nothing skipped it),
// after which every NaN/Inf is its consequence, not a new cause.
#include <cmath>
#include <string>

#include "ampdiag/analyzer/causes.h"
#include "rules.h"

namespace ampdiag::analyzer::rules {

void nonfinite_update(const Run& run, std::vector<Finding>& out) {
  if (run.first_nonfinite_update < 0) return;
  const StepSummary* at = nullptr;
  std::int64_t later = 0, later_bad = 0;
  for (const auto& s : run.steps) {
    if (s.row.step == run.first_nonfinite_update) at = &s;
    if (s.row.step <= run.first_nonfinite_update) continue;
    ++later;
    later_bad += after_nonfinite_update(run, s);
  }
  if (!at) return;
  const StepCause cause = step_cause(run, *at);
  Finding f;
  f.rule = "nonfinite-update";
  f.severity = Severity::kError;
  f.score = 92.0;
  f.steps = {at->row.step};
  f.title = "Step " + std::to_string(at->row.step) +
            "'s optimizer step applied NaN/Inf gradients: the parameters hold NaN/Inf from then on";
  f.evidence = "step " + std::to_string(at->row.step) + " was taken with NaN/Inf gradients" +
               (at->nonfinite_layers.empty() ? std::string()
                                             : " in " + plural(std::int64_t(at->nonfinite_layers.size()), "layer") +
                                                   " (first in backward: " + cause.first_gradient + ")") +
               (run.has_scaler() ? "" : "; without a loss scaler nothing skips such a step") + "; " +
               std::to_string(later_bad) + " of the " + plural(later, "step") +
               " after it went NaN/Inf, which this step explains: they name no cause of their own";
  const std::string what = forward_sentence(cause.forward, cause.forward_module);
  if (!what.empty()) f.evidence += "; in step " + std::to_string(at->row.step) + " " + what;
  f.suggestions.push_back(
      {"Skip an optimizer step whose gradients are not finite (the scaler does this for fp16), and fix what made step " +
           std::to_string(at->row.step) + "'s gradients NaN/Inf (the other findings name it).",
       "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
       "if torch.isfinite(norm):\n"
       "    optimizer.step()",
       "auto norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);\n"
       "if (std::isfinite(norm)) optimizer.step();",
       ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
