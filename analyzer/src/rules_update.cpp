// nonfinite-update: an optimizer step that wrote NaN/Inf into the parameters, by applying
// NaN/Inf gradients (nothing skipped it) or from finite ones (the agent found the
// parameters NaN/Inf: event "parameters-nonfinite"); nonfinite-parameters: they held
// NaN/Inf before any update. Every NaN/Inf after it is its consequence, not a new cause.
#include <cmath>
#include <string>

#include "ampdiag/analyzer/causes.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

bool trains_half_parameters(const Run& run) {
  for (const auto& l : run.layers)
    if (l.info.trainable && half_dtype(l.info.dtype)) return true;
  return false;
}

std::string found_in(const Run& run) {
  const rundb::EventRow* e = run.first_event("parameters-nonfinite");
  return "in step " + std::to_string(run.parameters_found_nonfinite) +
         ", which went NaN/Inf with a finite input, the agent found NaN/Inf in " + (e ? e->detail : "the parameters");
}

// "; K of the L steps after it went NaN/Inf, which WHAT explains: they name no cause of their own"
std::string consequences(const Run& run, const std::string& what) {
  const std::int64_t from = run.first_step_on_nonfinite_parameters();
  std::int64_t later = 0, later_bad = 0;
  for (const auto& s : run.steps) {
    if (s.row.step < from) continue;
    ++later;
    later_bad += after_nonfinite_update(run, s);
  }
  return "; " + std::to_string(later_bad) + " of the " + plural(later, "step") +
         (run.first_nonfinite_update >= 0 ? " after it" : " from step " + std::to_string(from) + " on") +
         " went NaN/Inf, which " + what + " explains: they name no cause of their own";
}

// Why an update makes NaN/Inf from finite gradients, and what to change, as far as the run says.
void update_fixes(const Run& run, Finding& f) {
  const bool half = trains_half_parameters(run);
  if (const rundb::EventRow* samples = applied_per_sample_nonfinite(run);
      samples != nullptr && samples->step <= run.first_nonfinite_update) {
    f.evidence += "; at step " + std::to_string(samples->step) + " " + samples->detail +
                  ", which the DP optimizer clips and sums into the update and the GradScaler never checks (see "
                  "per-sample-gradients)";
    f.suggestions.push_back(per_sample_fix(run));
    return;
  }
  if (const rundb::EventRow* eps = run.first_event("optimizer-eps")) {
    f.evidence += "; " + eps->detail;
    f.suggestions.push_back(
        {eps->detail + ": an element whose gradient is 0, or whose square is below float16's range, is divided by 0. "
                       "Give the optimizer an eps that float16 holds (1e-4), or keep FP32 master weights (below).",
         "for group in optimizer.param_groups:\n"
         "    group[\"eps\"] = 1e-4  # 1e-8 is 0 in float16",
         "torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-4));", ""});
  }
  if (half) {
    Suggestion s = suggest::fp32_master_weights(run);
    s.summary = "Keep FP32 master weights: the parameters are stored in half precision, so the optimizer's own "
                "arithmetic runs there, where its small constants round to 0 and its updates overflow. Leave them in "
                "float32 and run the forward under autocast (torch.amp does this by default).";
    f.suggestions.push_back(s);
    return;
  }
  f.suggestions.push_back(
      {"Look at what the optimizer's step does with finite gradients: a learning rate or momentum that drives the "
       "parameters past float32's range, a division by a state that can be 0, or code that changes the parameters "
       "after step() (a weight constraint, an average of weights).",
       "", "", ""});
}

Finding from_start(const Run& run) {
  Finding f;
  f.rule = "nonfinite-parameters";
  f.severity = Severity::kError;
  f.score = 93.0;
  f.steps = {run.parameters_found_nonfinite};
  // The Python agent read them at attach(): finite there, code between it and the optimizer's
  // step wrote them in place (SAM's first_step adding rho times gradients the scaler found
  // Inf in, its parameters NaN in the first step).
  if (run.meta_or("parameters_at_attach", "") == "finite") {
    const std::string step = std::to_string(run.parameters_found_nonfinite);
    f.title = "The parameters went NaN/Inf by step " + step + " before any optimizer step recorded: code outside the "
              "optimizer wrote them";
    f.evidence = found_in(run) + ", no recorded optimizer step ran before it, and they were all finite when attach() "
                 "read them: between the two, code that writes the parameters in place put NaN/Inf there" +
                 consequences(run, "this");
    f.suggestions.push_back(
        {"Look at what writes the parameters outside the optimizer's step: a sharpness-aware (SAM) first_step() that "
         "adds rho times the gradients, which hold NaN/Inf where the loss scale overflowed (take it only on finite "
         "unscaled gradients, as scaler.step() does for the real step); an average or swap of weights (EMA); a manual "
         "update under torch.no_grad(); a checkpoint loaded after attach().",
         "scaler.unscale_(optimizer)\n"
         "if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):\n"
         "    optimizer.first_step(zero_grad=True)  # SAM's ascent: not on gradients the scale overflowed",
         "", ""});
    return f;
  }
  f.title = "The parameters held NaN/Inf before the first optimizer step recorded: they came with the model";
  f.evidence = found_in(run) + ", and no recorded optimizer step ran before it" + consequences(run, "this");
  f.suggestions.push_back(
      {"Find where the model got them before training: the checkpoint it loaded, or its initialisation. Check them "
       "before the first step.",
       "bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]\n"
       "assert not bad, f\"NaN/Inf parameters: {bad}\"",
       "for (const auto& p : model->named_parameters())\n"
       "  TORCH_CHECK(torch::isfinite(p.value()).all().item<bool>(), \"NaN/Inf parameter \", p.key());",
       ""});
  return f;
}

}  // namespace

void nonfinite_update(const Run& run, std::vector<Finding>& out) {
  if (run.parameters_nonfinite_from_start()) {
    out.push_back(from_start(run));
    return;
  }
  if (run.first_nonfinite_update < 0) return;
  const StepSummary* at = nullptr;
  for (const auto& s : run.steps)
    if (s.row.step == run.first_nonfinite_update) at = &s;
  if (!at) return;
  const std::string step = std::to_string(at->row.step);
  Finding f;
  f.rule = "nonfinite-update";
  f.severity = Severity::kError;
  f.score = 92.0;
  f.steps = {at->row.step};
  if (run.update_from_finite_gradients) {
    // The parameters may have held NaN/Inf the forward did not read (an embedding's unused
    // rows) since an earlier update: this is the last one that could have written them.
    f.title = "The optimizer wrote NaN/Inf into the parameters from finite gradients, by step " + step + "'s update";
    f.evidence = found_in(run) + "; no step before it applied NaN/Inf gradients, so an update made them: the last, step " +
                 step + "'s, had finite gradients" + consequences(run, "that update");
    update_fixes(run, f);
    out.push_back(f);
    return;
  }
  const StepCause cause = step_cause(run, *at);
  f.title = "Step " + step + "'s optimizer step applied NaN/Inf gradients: the parameters hold NaN/Inf from then on";
  f.evidence = "step " + step + " was taken with NaN/Inf gradients" +
               (at->nonfinite_layers.empty() ? std::string()
                                             : " in " + plural(std::int64_t(at->nonfinite_layers.size()), "layer") +
                                                   " (first in backward: " + cause.first_gradient + ")") +
               (run.has_scaler() ? "" : "; without a loss scaler nothing skips such a step") +
               consequences(run, "this step");
  const std::string what = forward_sentence(cause.forward, cause.forward_module);
  if (!what.empty()) f.evidence += "; in step " + step + " " + what;
  f.suggestions.push_back(
      {"Skip an optimizer step whose gradients are not finite (the scaler does this for fp16), and fix what made step " +
           step + "'s gradients NaN/Inf (the other findings name it).",
       "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
       "if torch.isfinite(norm):\n"
       "    optimizer.step()",
       "auto norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);\n"
       "if (std::isfinite(norm)) optimizer.step();",
       ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
