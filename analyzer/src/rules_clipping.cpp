// clip-before-unscale: clip_grad_norm_ ran on the gradients while they were still
// multiplied by the loss scale (no scaler.unscale_() before it). Torch raises nothing and
// no value goes NaN/Inf: the scaler then divides the clipped gradients by the scale, and
// every update is cut to max_norm / scale. The statistics are taken where the scaler
// unscales, after the user's clip, so the gradients' total norm there is max_norm in every
// step, whatever the scale: the scaled norm of gradients that were not clipped moves with
// the batch and doubles with the scale.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "rules.h"

namespace ampdiag::analyzer::rules {

std::map<std::int64_t, StepGradients> gradients_by_step(const Run& run) {
  std::map<std::int64_t, StepGradients> by_step;
  for (const auto& layer : run.layers)
    for (const auto& s : layer.samples) {
      StepGradients& g = by_step[s.step];
      g.sumsq += double(s.l2) * double(s.l2);
      g.finite = g.finite && !s.nonfinite;
      g.all_zero = g.all_zero && !s.nonfinite && s.absmax == 0.0f;
    }
  return by_step;
}

namespace {

// Norms within this relative distance are one value: a clipped norm differs between steps
// only by float32 rounding (of the clip and of the stored l2), ~1e-7.
constexpr double kSameNorm = 1e-4;
constexpr std::int64_t kMinClippedSteps = 5;

struct StepNorm {
  std::int64_t step;
  double scale;
  double norm;  // of every gradient the step recorded, before unscale
};

// The total norm of each taken step at a scale above 1 whose gradients were all recorded
// and finite (at a scale of 1 clipping the scaled gradients is clipping the true ones).
std::vector<StepNorm> taken_step_norms(const Run& run) {
  const std::map<std::int64_t, StepGradients> by_step = gradients_by_step(run);
  std::vector<StepNorm> norms;
  for (const auto& s : run.steps) {
    const auto it = by_step.find(s.row.step);
    if (it == by_step.end() || !it->second.finite || s.row.skipped || s.row.found_inf || s.row.scale_before <= 1.0)
      continue;
    if (it->second.sumsq > 0.0) norms.push_back({s.row.step, s.row.scale_before, std::sqrt(it->second.sumsq)});
  }
  return norms;
}

}  // namespace

void clip_before_unscale(const Run& run, std::vector<Finding>& out) {
  if (!run.has_scaler()) return;  // without a scaler the statistics are taken after any clip
  const std::vector<StepNorm> norms = taken_step_norms(run);
  if (std::int64_t(norms.size()) < kMinClippedSteps) return;
  // A norm most steps share is their median: the steps within kSameNorm of it.
  std::vector<double> sorted;
  for (const auto& n : norms) sorted.push_back(n.norm);
  std::nth_element(sorted.begin(), sorted.begin() + std::ptrdiff_t(sorted.size() / 2), sorted.end());
  const double pinned = sorted[sorted.size() / 2];
  std::vector<StepNorm> at;
  std::set<double> scales;
  for (const auto& n : norms)
    if (std::abs(n.norm - pinned) <= kSameNorm * pinned) {
      at.push_back(n);
      scales.insert(n.scale);
    }
  if (std::int64_t(at.size()) < kMinClippedSteps || 2 * at.size() <= norms.size()) return;
  const double scale = at.front().scale;
  Finding f;
  f.rule = "clip-before-unscale";
  f.severity = Severity::kError;
  f.score = 95.0;
  f.steps = {at.front().step};
  f.title = "The gradients were clipped while still multiplied by the loss scale: each update was cut to " +
            fmt(pinned) + " / scale (" + fmt(pinned / scale) + " at " + fmt(scale) + ")";
  f.evidence = "before unscale, the total norm of the " + plural(std::int64_t(run.layers.size()), "gradient") +
               " was " + fmt(pinned) + " (within 0.01 %) in " + std::to_string(at.size()) + " of " +
               plural(std::int64_t(norms.size()), "step") + " taken at a loss scale above 1, from step " +
               std::to_string(at.front().step);
  if (scales.size() > 1)
    f.evidence += ", at loss scales " + fmt(*scales.rbegin()) + " down to " + fmt(*scales.begin()) + " alike";
  f.evidence += ": a norm the batch and the scale do not move is a clip applied to the scaled gradients "
                "(clip_grad_norm_(..., max_norm=" + fmt(pinned) + ") before scaler.unscale_()); the scaler then "
                "divides them by the scale, so the optimizer received a norm of " + fmt(pinned / scale) +
                ", not " + fmt(pinned);
  f.suggestions.push_back(
      {"Unscale before clipping: scaler.unscale_(optimizer) right after backward, then clip the true gradients; "
       "scaler.step() does not unscale them twice.",
       "scaler.scale(loss).backward()\n"
       "scaler.unscale_(optimizer)  # the gradients' true values, before the clip\n"
       "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=" + fmt(pinned) + ")\n"
       "scaler.step(optimizer)\n"
       "scaler.update()",
       "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
       "scaler.unscale_(optimizer);  // the gradients' true values, before the clip\n"
       "torch::nn::utils::clip_grad_norm_(model->parameters(), " + fmt(pinned) + ");\n"
       "scaler.step(optimizer);\n"
       "scaler.update();",
       ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
