// optimizer-outside-scaler: in a loop that scales its loss, an optimizer stepped outside
// scaler.step() (event from the Python agent, which sees every optimizer's step). Either
// scaler.step() was never called, and every update applied gradients multiplied by the
// loss scale, or the optimizer stepped itself after scaler.unscale_(), and a step whose
// gradients held NaN/Inf was applied instead of skipped. Both run without an error from
// torch, and the run's NaN/Inf that follow are this finding's.
// unscaled-backward: backward() ran on the loss given to scaler.scale(), not on its output
// (event from the Python agent): the gradients never held the scale that scaler.step()
// divides them by, so every update is 1/scale of the gradient.
#include <string>

#include "rules.h"

namespace ampdiag::analyzer::rules {

bool updates_held_scale(const Run& run) {
  const rundb::EventRow* e = run.first_event("optimizer-outside-scaler");
  return e && e->detail.find("still multiplied by the loss scale") != std::string::npos;
}

void optimizer_outside_scaler(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("optimizer-outside-scaler");
  if (!e) return;
  const bool scaled = updates_held_scale(run);
  std::int64_t applied = 0, first_applied = -1, first_bad_loss = -1;
  for (const auto& s : run.steps) {
    if (s.row.found_inf && !s.row.skipped && ++applied == 1) first_applied = s.row.step;
    if (run.loss_nonfinite(s.row) && first_bad_loss < 0) first_bad_loss = s.row.step;
  }
  Finding f;
  f.rule = "optimizer-outside-scaler";
  f.severity = scaled || applied > 0 ? Severity::kError : Severity::kWarning;
  f.score = 101.0;  // above scale-collapse (100) and nonfinite-update (92): their NaN/Inf is its
  f.steps = {e->step >= 0 ? e->step : run.steps.front().row.step};
  if (scaled)
    f.title = "The optimizer stepped outside scaler.step(): every update applied gradients still multiplied by the "
              "loss scale";
  else if (applied > 0)
    f.title = "The optimizer stepped outside scaler.step(): steps whose gradients held NaN/Inf were applied, not skipped";
  else
    f.title = "The optimizer steps outside scaler.step(): a step whose gradients hold NaN/Inf will be applied, not "
              "skipped";
  f.evidence = "from step " + std::to_string(f.steps.front()) + ", " + e->detail;
  if (applied > 0)
    f.evidence += "; " + plural(applied, "step") + " applied NaN/Inf gradients, first step " + std::to_string(first_applied);
  else if (!scaled)
    f.evidence += "; no step's gradients held NaN/Inf yet";
  if (const Divergence d = find_divergence(run); scaled && d.found)
    f.evidence += "; the loss grew " + d.factor() + " while finite, from step " + std::to_string(d.rise);
  if (first_bad_loss >= 0) f.evidence += "; the loss is NaN/Inf from step " + std::to_string(first_bad_loss);
  const std::string summary =
      "Step the optimizer through the scaler: scaler.step(optimizer) unscales the gradients (unless scaler.unscale_() "
      "already did) and skips the step when they hold NaN/Inf; then scaler.update() adjusts the scale.";
  if (scaled)
    f.suggestions.push_back({summary,
                             "scaler.scale(loss).backward()\n"
                             "scaler.step(optimizer)  # not optimizer.step()\n"
                             "scaler.update()",
                             "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
                             "scaler.step(optimizer);  // not optimizer.step()\n"
                             "scaler.update();",
                             ""});
  else
    f.suggestions.push_back({summary,
                             "scaler.scale(loss).backward()\n"
                             "scaler.unscale_(optimizer)\n"
                             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # what runs in between\n"
                             "scaler.step(optimizer)  # not optimizer.step(): it skips a NaN/Inf step\n"
                             "scaler.update()",
                             "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
                             "scaler.unscale_(optimizer);\n"
                             "torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);\n"
                             "scaler.step(optimizer);  // not optimizer.step(): it skips a NaN/Inf step\n"
                             "scaler.update();",
                             ""});
  out.push_back(f);
}

void unscaled_backward(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("unscaled-backward");
  if (!e) return;
  Finding f;
  f.rule = "unscaled-backward";
  f.severity = Severity::kError;
  f.score = 101.0;  // above the symptoms: an underflow, a loss that does not fall
  f.steps = {e->step >= 0 ? e->step : run.steps.front().row.step};
  double scale = 0.0;
  for (const auto& s : run.steps)
    if (s.row.step == f.steps.front()) scale = s.row.scale_before;
  f.title = "backward() ran on the loss, not on scaler.scale(loss): the gradients were never multiplied by the loss "
            "scale, and scaler.step() divided them by it";
  f.evidence = "from step " + std::to_string(f.steps.front()) + ", " + e->detail;
  if (scale > 0.0)
    f.evidence += "; at a loss scale of " + fmt(scale) + " every update was " + fmt(1.0 / scale) +
                  " of its gradient, and fp16's small gradients were left unprotected";
  f.suggestions.push_back({"Call backward() on what scaler.scale() returns: that multiplies the gradients by the scale, "
                           "which scaler.step() divides back out.",
                           "scaler.scale(loss).backward()  # not loss.backward()\n"
                           "scaler.step(optimizer)\n"
                           "scaler.update()",
                           "scaler.scale(loss).backward();  // ampdiag::GradScaler; not loss.backward()\n"
                           "scaler.step(optimizer);\n"
                           "scaler.update();",
                           ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
