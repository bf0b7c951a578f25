// optimizer-outside-scaler: in a loop that scales its loss, an optimizer stepped outside
// scaler.step() (event from the Python agent, which sees every optimizer's step). Either
// scaler.step() was never called, and every update applied gradients multiplied by the
// loss scale, or the optimizer stepped itself after scaler.unscale_(), and a step whose
// gradients held NaN/Inf was applied instead of skipped. Both run without an error from
// torch, and the run's NaN/Inf that follow are this finding's.
// unscaled-backward: backward() ran on the loss given to scaler.scale(), not on its output
// (event from the Python agent): the gradients never held the scale that scaler.step()
// divides them by, so every update is 1/scale of the gradient.
// scale-held: skipped steps whose scale did not back off (update(new_scale=...), or a
// scale set after update()): every step that overflows at that scale is skipped again.
#include <algorithm>
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

void scale_held(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  if (!run.has_scaler()) return;
  // torch requires backoff_factor below 1: a skipped step whose scale did not fall had it set
  // after the back-off (update(new_scale=...), a second update() or a load_state_dict()).
  std::vector<std::int64_t> held;
  double scale = 0.0;
  for (const auto& s : run.steps)
    if (s.row.skipped && s.row.found_inf && s.row.scale_before > 0.0 && s.row.scale_after >= s.row.scale_before) {
      held.push_back(s.row.step);
      scale = std::max(scale, s.row.scale_after);
    }
  constexpr std::size_t kMinHeld = 2;
  if (held.size() < kMinHeld) return;
  std::int64_t skipped = 0;
  for (const auto& s : run.steps) skipped += s.row.skipped;
  const rundb::EventRow* set = run.first_event("update-new-scale");
  Finding f;
  f.rule = "scale-held";
  const double share = double(held.size()) / double(run.steps.size());
  f.severity = share > t.skip_rate ? Severity::kError : Severity::kWarning;  // skips the skip rate counts
  f.score = 101.0;  // before what it causes: the skips, and the overflows that the scale holds
  f.steps = {held.front()};
  f.title = "The loss scale is held by hand: it did not back off after " + plural(std::int64_t(held.size()), "overflow") +
            ", so each step that overflows at it is skipped";
  f.evidence = std::to_string(held.size()) + " of " + plural(skipped, "skipped step") +
               " kept their scale (up to " + fmt(scale) + " before and after; steps " + step_list(held) +
               "), where a GradScaler lowers it after each overflow (its backoff_factor, which torch requires below "
               "1): " + (set ? "scaler.update(new_scale=" + set->detail + ") set it, from step " + std::to_string(set->step)
                              : "something sets it after the back-off: update(new_scale=...), a second update() or "
                                "load_state_dict()");
  f.suggestions.push_back({"Let the scaler set the scale: call scaler.update() without new_scale, so that an overflow "
                           "lowers the scale and the next step is taken at one the gradients fit; it grows again once "
                           "they allow. A minimum held by hand skips every step that overflows at it: where one is "
                           "needed, hold it only below where the gradients overflow.",
                           "scaler.step(optimizer)\nscaler.update()  # not scaler.update(new_scale=...)",
                           "scaler.step(optimizer);\nscaler.update();  // not scaler.update(new_scale)",
                           ""});
  // The overflows it keeps skipping, and the skip rate, are its doing.
  const std::string see = "The scale is held by hand (see scale-held): ";
  for (auto& g : out) {
    const auto within = std::count_if(g.steps.begin(), g.steps.end(), [&](std::int64_t step) {
      return std::binary_search(held.begin(), held.end(), step);
    });
    if (g.rule == "overflow-origin" && !g.steps.empty() && 2 * within > std::int64_t(g.steps.size())) {
      if (g.severity == Severity::kError) g.severity = Severity::kWarning;
      g.evidence += "; these skips are at a scale held by hand";
      g.suggestions.insert(g.suggestions.begin(),
                           {see + "let the scaler lower it first; what follows holds only if these gradients still "
                                  "overflow at the scale it settles at.",
                            "", "", ""});
    } else if (g.rule == "skip-rate" || g.rule == "scale-collapse") {
      g.suggestions = {{see + "let the scaler lower it, and the steps at a scale the gradients fit are taken.", "", "",
                        ""}};
    }
  }
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
