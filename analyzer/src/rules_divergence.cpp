// loss-divergence: the loss grew by orders of magnitude while every step was finite, and
// only then overflowed or went NaN/Inf. A learning rate too high (or no warm-up, no
// clipping) drives the weights and activations up until fp16's range ends: the module that
// overflows first is where it shows, not why, and pinning it to FP32 only delays the NaN.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "rules.h"

namespace ampdiag::analyzer::rules {

namespace {

// How far above its start the loss must climb, and how far above it the climb starts. A
// loss that only spikes and comes back (a hard batch) is not a divergence: from its onset
// to the first NaN/Inf every finite loss stays at least kStaysAbove times the start.
constexpr double kDiverged = 1000.0, kRising = 10.0, kStaysAbove = 100.0;
constexpr std::size_t kBaselineSteps = 5;

// Steps with NaN/Inf anywhere: skipped, a NaN/Inf loss, or a NaN/Inf module output.
bool troubled(const Run& run, const StepSummary& s) {
  return s.row.skipped || s.row.found_inf || run.loss_nonfinite(s.row) || s.first_nonfinite_module >= 0;
}

}  // namespace

void point_to_cause(std::vector<Finding>& out, std::int64_t from_step, const std::string& see,
                    const std::string& after) {
  for (auto& g : out) {
    if (!g.steps.empty() && g.steps.front() < from_step) continue;
    if (g.rule == "forward-nonfinite" || g.rule == "overflow-origin" || g.rule == "loss-backward") {
      if (g.severity == Severity::kError) g.severity = Severity::kWarning;
      g.evidence += "; " + after;
      g.suggestions.insert(g.suggestions.begin(), {see + "fix that first; what follows holds only if it still "
                                                   "overflows without it.", "", "", "", /*untried=*/true});
    } else if (g.rule == "scale-collapse" || g.rule == "skip-rate") {
      g.suggestions = {{see + "fix that, and these overflows go with it.", "", "", ""}};
    }
  }
}

std::string Divergence::factor() const {
  char b[32];
  const double r = peak / baseline;
  std::snprintf(b, sizeof b, r < 1e4 ? "%.0fx" : "%.1ex", r);
  return b;
}

Divergence find_divergence(const Run& run) {
  Divergence d;
  std::vector<double> start;
  for (const auto& s : run.steps)
    if (start.size() < kBaselineSteps && run.loss_known(s.row) && std::isfinite(s.row.loss) && s.row.loss > 0.0)
      start.push_back(s.row.loss);
  if (start.size() < 3) return d;  // too few losses to say where it started
  d.baseline = median_of(start);
  std::size_t onset = run.steps.size(), first_bad = run.steps.size();
  // A NaN/Inf loss while the loss is already kRising times its start ends that climb short
  // of kDiverged: it did not grow "while finite", and a finite loss between its NaNs (one
  // step at a lowered scale) is no onset. A climb begins again once the loss is back down.
  bool climbing = false, broken = false;
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const auto& row = run.steps[i].row;
    if (run.loss_nonfinite(row)) {
      if (onset == run.steps.size()) {  // an earlier NaN of its own, not this climb's, or one that ends it
        broken = broken || climbing;
        continue;
      }
      first_bad = i;
      break;
    }
    if (!run.loss_known(row)) continue;
    climbing = row.loss >= kRising * d.baseline;
    broken = broken && climbing;
    if (onset == run.steps.size() && !broken && row.loss >= kDiverged * d.baseline) onset = i;
    if (onset < run.steps.size() && row.loss < kStaysAbove * d.baseline) return d;  // it came back: a spike
  }
  if (onset == run.steps.size()) return d;
  // The climb starts where the loss last passed kRising times its start before the onset.
  std::size_t rise = onset;
  while (rise > 0 && (!run.loss_known(run.steps[rise - 1].row) || run.steps[rise - 1].row.loss >= kRising * d.baseline))
    --rise;
  // Nothing to explain without NaN/Inf after the climb began.
  bool after = false;
  for (std::size_t i = rise; i < run.steps.size() && !after; ++i) after = troubled(run, run.steps[i]);
  if (!after) return d;
  d.found = true;
  d.rise = run.steps[rise].row.step;
  d.onset = run.steps[onset].row.step;
  d.first_nonfinite_loss = first_bad < run.steps.size() ? run.steps[first_bad].row.step : -1;
  for (std::size_t i = rise; i < first_bad; ++i)
    if (run.loss_known(run.steps[i].row) && run.steps[i].row.loss > d.peak) {
      d.peak = run.steps[i].row.loss;
      d.peak_step = run.steps[i].row.step;
    }
  return d;
}

void loss_divergence(const Run& run, std::vector<Finding>& out) {
  const Divergence d = find_divergence(run);
  if (!d.found) return;
  // Updates applied still multiplied by the loss scale grow it so: optimizer-outside-scaler says
  // why; a fused SGD's momentum started from uninitialised memory: fused-sgd-momentum.
  if (updates_held_scale(run) || fused_momentum_uninitialised(run)) return;
  std::int64_t troubled_steps = 0, first_troubled = -1;
  for (const auto& s : run.steps)
    if (s.row.step >= d.rise && troubled(run, s) && troubled_steps++ == 0) first_troubled = s.row.step;
  // Parameters the model took in at the step the loss rose (a block grown, a head swapped
  // in): the model changed there, not the way the optimizer moves it.
  std::vector<std::string> added;
  for (const auto& e : run.events)
    if (e.kind == "parameters-added" && e.step == d.rise) added.push_back(e.detail.substr(0, e.detail.find(" was added")));
  // The climb's evidence: where it started, `onward` (what happened at its start), its peak
  // and the NaN/Inf after it, `nonfinite_loss` with or without, and `what` left the range.
  const auto climb = [&](const std::string& onward, bool nonfinite_loss, const std::string& what) {
    return "loss " + fmt(d.baseline) + " at the start (median of its first steps), above " + fmt(kRising) +
           "x that from step " + std::to_string(d.rise) + onward + ", up to " + fmt(d.peak) + " at step " +
           std::to_string(d.peak_step) + "; " + plural(troubled_steps, "step") + " with NaN/Inf or a skip from step " +
           std::to_string(first_troubled) +
           (nonfinite_loss && d.first_nonfinite_loss >= 0
                ? ", the loss NaN/Inf from step " + std::to_string(d.first_nonfinite_loss)
                : std::string()) +
           ". The overflows that follow are where " + what + " left fp16's range, not why";
  };
  Finding f;
  f.rule = "loss-divergence";
  f.severity = Severity::kError;
  f.score = 102.0;  // before the overflows it causes (scale-collapse 100)
  f.steps = {d.rise};
  if (!added.empty()) {
    std::string names;
    for (std::size_t i = 0; i < added.size() && i < 3; ++i) names += (i ? ", " : "") + added[i];
    if (added.size() > 3) names += " and " + plural(std::int64_t(added.size() - 3), "more");
    f.title = "The loss rose at step " + std::to_string(d.rise) + ", the step parameters were added to the model (" +
              names + "), and grew " + d.factor() + " before the NaN/Inf";
    f.evidence = climb(", the step the model first ran with " + names, false, "the new modules' outputs");
    f.suggestions.push_back(
        {"Look at what was added at step " + std::to_string(d.rise) + ": its initialisation (oversized-weights "
         "names a layer whose weights start far too large) and the scale of its output where it enters the model. "
         "Where it adds to a residual stream it can start adding nothing (its last layer zero-initialised).",
         "for m in new_block.modules():  # torch's default initialisation, where the block's was changed\n"
         "    if hasattr(m, \"reset_parameters\"):\n"
         "        m.reset_parameters()\n"
         "# where it adds to a residual stream, it can start adding nothing:\n"
         "# torch.nn.init.zeros_(new_block[-1].weight)",
         "// where the block is made, torch's default initialisation of each of its modules:\n"
         "// module->reset_parameters();",
         ""});
    point_to_cause(out, d.rise, "The loss rose where parameters were added (see loss-divergence): ",
                   "it comes after the loss rose at step " + std::to_string(d.rise) +
                       ", where parameters were added to the model");
    out.push_back(f);
    return;
  }
  f.title = "The loss diverged before anything overflowed: it grew " + d.factor() + " while finite, and the NaN/Inf came after";
  f.evidence = climb(", above " + fmt(kDiverged) + "x from step " + std::to_string(d.onset), true, "the growth");
  // Steps taken on gradients that a module without parameters enlarged (a gradient
  // reversal's lambda far above 1): its code first, then the learning rate.
  const std::optional<SenderCode> sender = sender_code_in(run, out, "");
  if (sender) {
    f.evidence += "; " + sender->sender + ", which holds no parameters, sent " + sender->receiver +
                  " NaN/Inf from a finite gradient at step " + std::to_string(sender->step) +
                  " (see overflow-origin): the steps that followed took gradients its code enlarges";
    f.suggestions.push_back(sender->look);
  }
  const std::string summary =
      "Lower the learning rate (or warm it up) and clip the gradient norm: the weights and activations grow until "
      "the half-precision range ends. Pinning the module that overflows first to FP32 only delays the NaN.";
  if (run.has_scaler())
    f.suggestions.push_back({summary,
                             "scaler.scale(loss).backward()\n"
                             "scaler.unscale_(optimizer)\n"
                             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
                             "scaler.step(optimizer)\n"
                             "scaler.update()",
                             "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
                             "scaler.unscale_(optimizer);\n"
                             "torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);\n"
                             "scaler.step(optimizer);\n"
                             "scaler.update();",
                             ""});
  else
    f.suggestions.push_back({summary,
                             "loss.backward()\n"
                             "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
                             "optimizer.step()",
                             "loss.backward();\n"
                             "torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);\n"
                             "optimizer.step();",
                             ""});
  point_to_cause(out, d.rise, "The loss was diverging (see loss-divergence): ",
                 "it comes after the loss grew " + d.factor() + " from step " + std::to_string(d.rise));
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
