// clip-before-unscale: clip_grad_norm_ ran on the gradients while they were still
// multiplied by the loss scale (no scaler.unscale_() before it). Torch raises nothing and
// no value goes NaN/Inf: the scaler then divides the clipped gradients by the scale, and
// every update is cut to max_norm / scale. The statistics are taken where the scaler
// unscales, after the user's clip, so the gradients' total norm there is max_norm in every
// step, whatever the scale: the scaled norm of gradients that were not clipped moves with
// the batch and doubles with the scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

std::map<std::int64_t, StepGradients> gradients_by_step(const Run& run) {
  // Summed in a vector indexed by step, not by looking each of the run's samples up in the
  // map: on 10 M samples the lookups took 0.45 s of a 1.4 s report.
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = std::numeric_limits<std::int64_t>::min();
  for (const auto& layer : run.layers)
    for (const auto& s : layer.samples) {
      lo = std::min<std::int64_t>(lo, s.step);
      hi = std::max<std::int64_t>(hi, s.step);
    }
  std::map<std::int64_t, StepGradients> by_step;
  if (hi < lo) return by_step;
  std::vector<StepGradients> dense(std::size_t(hi - lo + 1));
  std::vector<bool> seen(dense.size(), false);
  for (const auto& layer : run.layers)
    for (const auto& s : layer.samples) {
      const std::size_t i = std::size_t(s.step - lo);
      StepGradients& g = dense[i];
      seen[i] = true;
      g.sumsq += double(s.l2) * double(s.l2);
      g.finite = g.finite && !s.nonfinite;
      g.all_zero = g.all_zero && !s.nonfinite && s.absmax == 0.0f;
    }
  for (std::size_t i = 0; i < dense.size(); ++i)
    if (seen[i]) by_step.emplace_hint(by_step.end(), lo + std::int64_t(i), dense[i]);
  return by_step;
}

namespace {

// Norms within this relative distance are one value: a clipped norm differs between steps
// only by float32 rounding (of the clip and of the stored l2), ~1e-7.
constexpr double kSameNorm = 1e-4;
constexpr std::int64_t kMinClippedSteps = 5;
// Steps a module's own norm is looked at in: enough to see a pinned norm, and bounded so
// that a run of 100,000 steps costs no more than a short one.
constexpr std::size_t kModuleSteps = 256;

struct StepNorm {
  std::int64_t step;
  double scale;
  double norm;  // of the gradients looked at, before unscale
};

// The gradients clip_grad_norm_ may have been given: every recorded one (module empty), or
// those of one module (model.encoder.parameters()).
struct Clipped {
  std::string module;
  std::vector<bool> layers;  // by layer id; empty: every layer
  std::int64_t count = 0;
};

// The taken steps at a scale above 1 whose gradients were all recorded and finite (at a
// scale of 1 clipping the scaled gradients is clipping the true ones): at most `limit`.
std::vector<const StepSummary*> looked_at_steps(const Run& run, const std::map<std::int64_t, StepGradients>& by_step,
                                                std::size_t limit) {
  std::vector<const StepSummary*> steps;
  for (const auto& s : run.steps) {
    if (steps.size() >= limit) break;
    const auto it = by_step.find(s.row.step);
    if (it == by_step.end() || !it->second.finite || s.row.skipped || s.row.found_inf || s.row.scale_before <= 1.0)
      continue;
    steps.push_back(&s);
  }
  return steps;
}

// The total norm of the gradients of `clipped` in each of `steps` (in step order).
std::vector<StepNorm> step_norms(const Run& run, const std::map<std::int64_t, StepGradients>& by_step,
                                 const std::vector<const StepSummary*>& steps, const Clipped& clipped) {
  std::vector<double> sumsq(steps.size(), 0.0);
  if (clipped.layers.empty()) {
    for (std::size_t i = 0; i < steps.size(); ++i) sumsq[i] = by_step.at(steps[i]->row.step).sumsq;
  } else if (!steps.empty()) {
    // Each layer's samples are in step order, as `steps` are: one pass up to the last.
    for (std::size_t l = 0; l < run.layers.size(); ++l) {
      if (!clipped.layers[l]) continue;
      std::size_t i = 0;
      for (const auto& s : run.layers[l].samples) {
        while (i < steps.size() && steps[i]->row.step < s.step) ++i;
        if (i == steps.size()) break;
        if (steps[i]->row.step == s.step) sumsq[i] += double(s.l2) * double(s.l2);
      }
    }
  }
  std::vector<StepNorm> norms;
  for (std::size_t i = 0; i < steps.size(); ++i)
    if (sumsq[i] > 0.0) norms.push_back({steps[i]->row.step, steps[i]->row.scale_before, std::sqrt(sumsq[i])});
  return norms;
}

// The modules one or two levels deep holding at least two recorded layers, the largest
// first: one gradient alone may have a norm that never moves (a parameter the loss adds
// as w.sum()), and users clip a model's parts (model.encoder), rarely a deep block.
std::vector<Clipped> module_subsets(const Run& run) {
  std::map<std::string, Clipped> by_path;
  for (std::size_t l = 0; l < run.layers.size(); ++l) {
    const std::string& name = run.layers[l].info.name;
    std::size_t dot = name.find('.');
    for (int depth = 0; depth < 2 && dot != std::string::npos; ++depth, dot = name.find('.', dot + 1)) {
      Clipped& c = by_path[name.substr(0, dot)];
      if (c.layers.empty()) {
        c.module = name.substr(0, dot);
        c.layers.assign(run.layers.size(), false);
      }
      c.layers[l] = true;
      ++c.count;
    }
  }
  std::vector<Clipped> subsets;
  for (auto& [path, c] : by_path)
    if (c.count >= 2 && c.count < std::int64_t(run.layers.size())) subsets.push_back(std::move(c));
  std::stable_sort(subsets.begin(), subsets.end(), [](const Clipped& a, const Clipped& b) { return a.count > b.count; });
  return subsets;
}

struct Pinned {
  double norm = 0.0;
  std::vector<StepNorm> at;  // the steps at that norm
  std::set<double> scales;   // their loss scales
  std::size_t looked = 0;    // steps looked at
};

// A norm most of the steps share (their median, within kSameNorm), if enough of them do.
bool pinned_norm(const std::vector<StepNorm>& norms, Pinned& p) {
  if (std::int64_t(norms.size()) < kMinClippedSteps) return false;
  std::vector<double> sorted;
  for (const auto& n : norms) sorted.push_back(n.norm);
  p.norm = median_of(sorted);
  p.looked = norms.size();
  for (const auto& n : norms)
    if (std::abs(n.norm - p.norm) <= kSameNorm * p.norm) {
      p.at.push_back(n);
      p.scales.insert(n.scale);
    }
  return std::int64_t(p.at.size()) >= kMinClippedSteps && 2 * p.at.size() > norms.size();
}

// clip_grad_value_ before unscale_: every recorded gradient's largest |value| is the clip
// value, in each step alike, whatever the batch and the scale, and most of their values sit
// at it (the scale lifts them all above any usual clip value: a quarter of the L2 energy
// the values would have there, at least). Gradients that merely share an abs-max keep
// most values far below it.
struct PinnedValue {
  double value = 0.0;
  std::int64_t layers = 0;   // gradients holding a value in the first step at it
  std::vector<const StepSummary*> at;
  std::set<double> scales;
  std::size_t looked = 0;
};

bool pinned_value(const Run& run, const std::vector<const StepSummary*>& steps, PinnedValue& p) {
  if (std::int64_t(steps.size()) < kMinClippedSteps) return false;
  // Per step, the smallest and largest non-zero abs-max over the layers, and how many.
  std::vector<double> lo(steps.size(), INFINITY), hi(steps.size(), 0.0);
  std::vector<std::int64_t> held(steps.size(), 0);
  std::vector<double> energy(steps.size(), 0.0), at_bound(steps.size(), 0.0);  // sums of l2², absmax² × nonzero
  for (const auto& layer : run.layers) {
    std::size_t i = 0;  // samples and steps are both in step order
    for (const auto& s : layer.samples) {
      while (i < steps.size() && steps[i]->row.step < s.step) ++i;
      if (i == steps.size()) break;
      if (steps[i]->row.step != s.step || !(s.absmax > 0.0f)) continue;
      lo[i] = std::min(lo[i], double(s.absmax));
      hi[i] = std::max(hi[i], double(s.absmax));
      ++held[i];
      const double nonzero = double(layer.info.numel) * (1.0 - double(s.zero_q) / 65535.0);
      energy[i] += double(s.l2) * double(s.l2);
      at_bound[i] += double(s.absmax) * double(s.absmax) * nonzero;
    }
  }
  const auto pins = [&](std::size_t i) {
    return held[i] >= 2 && hi[i] - lo[i] <= kSameNorm * hi[i] && 4.0 * energy[i] >= at_bound[i];
  };
  std::vector<double> values;
  for (std::size_t i = 0; i < steps.size(); ++i)
    if (pins(i)) values.push_back(hi[i]);
  p.looked = steps.size();
  if (2 * values.size() <= steps.size()) return false;
  p.value = median_of(values);
  for (std::size_t i = 0; i < steps.size(); ++i)
    if (pins(i) && std::abs(hi[i] - p.value) <= kSameNorm * p.value) {
      if (p.at.empty()) p.layers = held[i];
      p.at.push_back(steps[i]);
      p.scales.insert(steps[i]->row.scale_before);
    }
  return std::int64_t(p.at.size()) >= kMinClippedSteps && 2 * p.at.size() > steps.size();
}

const char* kUnscaleFirst = "Unscale before clipping: scaler.unscale_(optimizer) right after backward, then clip the "
                            "true gradients; scaler.step() does not unscale them twice.";

Finding clipped_by_value(const PinnedValue& p) {
  const double value = p.value, scale = p.at.front()->row.scale_before;
  Finding f;
  f.rule = "clip-before-unscale";
  f.severity = Severity::kError;
  f.score = 95.0;
  f.steps = {p.at.front()->row.step};
  f.title = "The gradients were clipped by value while still multiplied by the loss scale: every value was cut to ±" +
            fmt(value) + " / scale (" + fmt(value / scale) + " at " + fmt(scale) + ")";
  f.evidence = "before unscale, the largest |value| of each of the " + plural(p.layers, "gradient") + " was " +
               fmt(value) + " (within 0.01 %) in " + std::to_string(p.at.size()) + " of " +
               (p.looked == kModuleSteps ? "the first " : "") + plural(std::int64_t(p.looked), "step") +
               " taken at a loss scale above 1, from step " + std::to_string(p.at.front()->row.step);
  if (p.scales.size() > 1)
    f.evidence += ", at loss scales " + fmt(*p.scales.rbegin()) + " down to " + fmt(*p.scales.begin()) + " alike";
  f.evidence += ": a bound that neither the batch nor the scale moves is a clip by value applied to the scaled "
                "gradients (clip_grad_value_(..., clip_value=" + fmt(value) + ") before scaler.unscale_()); the scaler "
                "then divides them by the scale, so no value the optimizer received exceeded " + fmt(value / scale);
  f.suggestions.push_back({kUnscaleFirst,
                           "scaler.scale(loss).backward()\n"
                           "scaler.unscale_(optimizer)  # the gradients' true values, before the clip\n"
                           "torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=" + fmt(value) + ")\n"
                           "scaler.step(optimizer)\n"
                           "scaler.update()",
                           "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
                           "scaler.unscale_(optimizer);  // the gradients' true values, before the clip\n"
                           "torch::nn::utils::clip_grad_value_(model->parameters(), " + fmt(value) + ");\n"
                           "scaler.step(optimizer);\n"
                           "scaler.update();",
                           ""});
  return f;
}

}  // namespace

void clip_before_unscale(const Run& run, const std::map<std::int64_t, StepGradients>& by_step,
                         std::vector<Finding>& out) {
  if (!run.has_scaler()) return;  // without a scaler the statistics are taken after any clip
  // By value first: its per-gradient bound also pins each part's norm (all of a layer's
  // values at the bound), which the norm's test would take for clip_grad_norm_ of that part.
  const std::vector<const StepSummary*> first = looked_at_steps(run, by_step, kModuleSteps);
  if (PinnedValue v; pinned_value(run, first, v)) {
    out.push_back(clipped_by_value(v));
    return;
  }
  Clipped clipped;
  clipped.count = std::int64_t(run.layers.size());
  Pinned p;
  // Every gradient first; else a part of the model clipped alone (clip_grad_norm_ of
  // model.encoder.parameters() before unscale): that part barely trains, the rest does.
  bool found = pinned_norm(step_norms(run, by_step, looked_at_steps(run, by_step, SIZE_MAX), clipped), p);
  if (!found) {
    for (Clipped& c : module_subsets(run)) {
      p = Pinned{};
      if (pinned_norm(step_norms(run, by_step, first, c), p)) {
        clipped = std::move(c);
        found = true;
        break;
      }
    }
  }
  if (!found) return;
  const double pinned = p.norm, scale = p.at.front().scale;
  const std::string whose = clipped.module.empty() ? "" : " of " + clipped.module;
  const std::string params =
      clipped.module.empty() ? "model.parameters()" : suggest::python_attribute(clipped.module) + ".parameters()";
  const std::string cpp_params =
      clipped.module.empty() ? "model->parameters()" : "model->named_modules()[\"" + clipped.module + "\"]->parameters()";
  Finding f;
  f.rule = "clip-before-unscale";
  f.severity = Severity::kError;
  f.score = 95.0;
  f.module = clipped.module;
  f.steps = {p.at.front().step};
  f.title = "The gradients" + whose + " were clipped while still multiplied by the loss scale: each update" + whose +
            " was cut to " + fmt(pinned) + " / scale (" + fmt(pinned / scale) + " at " + fmt(scale) + ")";
  f.evidence = "before unscale, the total norm of " + (clipped.module.empty() ? "the " : clipped.module + "'s ") +
               plural(clipped.count, "gradient") + " was " + fmt(pinned) + " (within 0.01 %) in " +
               std::to_string(p.at.size()) + " of " + (p.looked == kModuleSteps ? "the first " : "") +
               plural(std::int64_t(p.looked), "step") + " taken at a loss scale above 1, from step " +
               std::to_string(p.at.front().step);
  if (p.scales.size() > 1)
    f.evidence += ", at loss scales " + fmt(*p.scales.rbegin()) + " down to " + fmt(*p.scales.begin()) + " alike";
  f.evidence += ": a norm the batch and the scale do not move is a clip applied to the scaled gradients "
                "(clip_grad_norm_(..., max_norm=" + fmt(pinned) + ") before scaler.unscale_()); the scaler then "
                "divides them by the scale, so the optimizer received a norm of " + fmt(pinned / scale) +
                ", not " + fmt(pinned);
  f.suggestions.push_back(
      {kUnscaleFirst,
       "scaler.scale(loss).backward()\n"
       "scaler.unscale_(optimizer)  # the gradients' true values, before the clip\n"
       "torch.nn.utils.clip_grad_norm_(" + params + ", max_norm=" + fmt(pinned) + ")\n"
       "scaler.step(optimizer)\n"
       "scaler.update()",
       "scaler.scale(loss).backward();  // ampdiag::GradScaler\n"
       "scaler.unscale_(optimizer);  // the gradients' true values, before the clip\n"
       "torch::nn::utils::clip_grad_norm_(" + cpp_params + ", " + fmt(pinned) + ");\n"
       "scaler.step(optimizer);\n"
       "scaler.update();",
       ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
