// what_if() and search_configs(); see whatif.h.
#include "ampdiag/analyzer/whatif.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>

#include "ampdiag/analyzer/causes.h"
#include "ampdiag/rundb/reader.h"
#include "calibration.h"
#include "rules.h"

namespace ampdiag::analyzer {

namespace {

enum class Known { kOverflow, kMagnitude, kFiniteUpTo, kOverflowFrom };

// What the recording says of one step, independent of the scale replayed.
struct StepFacts {
  Known kind = Known::kFiniteUpTo;
  double magnitude = 0.0;  // kMagnitude: the largest finite |g| unscaled
  double scale = 0.0;      // the scale it was recorded at
  double estimate = 0.0;   // the magnitude the estimate assumes (with the overflow inside backward)
  // Taken when recorded, or one of the recording's own calibration skips: a replayed
  // calibration skip here is one the scale avoids once settled. A skip that hurt the
  // recording (a diverging run's) is not, whatever the replayed scale did before it.
  bool settles = true;
};

// Fills `estimate` for the steps known on one side only: the larger magnitude of the nearest
// measured steps before and after, within what the step's own outcome allows.
void estimate_unknown(std::vector<StepFacts>& facts, double fp_max) {
  const std::size_t n = facts.size();
  std::vector<double> before(n, 0.0), after(n, 0.0);
  double last = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    before[i] = last;
    if (facts[i].kind == Known::kMagnitude) last = facts[i].magnitude;
  }
  last = 0.0;
  for (std::size_t i = n; i-- > 0;) {
    after[i] = last;
    if (facts[i].kind == Known::kMagnitude) last = facts[i].magnitude;
  }
  // Overflows the parameters' gradients do not explain: backward overflowed inside (an
  // activation's gradient), by a factor the parameters' magnitudes do not show. Each such
  // overflow is a lower bound on that factor; the largest, capped so that no recorded
  // finite step would have overflowed with it, scales every magnitude the estimate uses.
  double hidden = 1.0, cap = INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    const StepFacts& f = facts[i];
    const double near = std::max(before[i], after[i]);
    if (f.kind == Known::kOverflowFrom && near > 0) hidden = std::max(hidden, fp_max / f.scale / near);
    if (f.kind == Known::kMagnitude && f.magnitude > 0) cap = std::min(cap, fp_max / f.scale / f.magnitude);
  }
  hidden = std::max(1.0, std::min(hidden, cap));
  for (std::size_t i = 0; i < n; ++i) {
    StepFacts& f = facts[i];
    const double near = std::max(before[i], after[i]) * hidden;
    const double edge = fp_max / f.scale;  // the largest magnitude finite at its scale
    if (f.kind == Known::kMagnitude) f.estimate = f.magnitude * hidden;
    if (f.kind == Known::kFiniteUpTo) f.estimate = std::min(near, edge);
    if (f.kind == Known::kOverflowFrom) f.estimate = std::max(near, std::nextafter(edge, INFINITY));
  }
}

std::vector<StepFacts> facts_of(const Run& run, WhatIf& w) {
  // The largest finite |g| and whether anything was non-finite, per sampled step.
  std::map<std::int64_t, std::pair<float, bool>> sampled;
  for (const auto& layer : run.layers)
    for (const auto& s : layer.samples) {
      auto& [absmax, nonfinite] = sampled[s.step];
      absmax = std::max(absmax, s.absmax);
      nonfinite = nonfinite || s.nonfinite;
    }
  const std::size_t recorded_calibration = rules::calibration_end(run);
  std::vector<StepFacts> facts;
  facts.reserve(run.steps.size());
  for (const auto& step : run.steps) {
    StepFacts f;
    f.scale = step.row.scale_before;
    const std::size_t index = facts.size();
    f.settles = !step.row.skipped || rules::is_calibration(run, index, recorded_calibration);
    // A loss made of the scaled gradients (a gradient penalty) overflows with them.
    const bool loss_nonfinite = run.loss_nonfinite(step.row) && !run.loss_holds_scale(step.row);
    const bool overflowed = step.row.found_inf || step.row.skipped;
    if (overflowed && (loss_nonfinite || step_cause(run, step).forward != ForwardSource::kNone)) {
      f.kind = Known::kOverflow;
      ++w.always_skipped;
    } else if (overflowed) {
      f.kind = Known::kOverflowFrom;
      ++w.censored;
    } else if (const auto it = sampled.find(step.row.step); it != sampled.end() && !it->second.second) {
      f.kind = Known::kMagnitude;
      f.magnitude = double(it->second.first) / f.scale;
    } else {
      f.kind = Known::kFiniteUpTo;
      ++w.unrecorded;
    }
    facts.push_back(f);
  }
  return facts;
}

enum class Resolve { kFinite, kOverflow, kEstimate };

// Whether the step overflows at `scale`; `resolve` decides what the recording cannot tell.
bool overflows(const StepFacts& f, double scale, double fp_max, Resolve resolve) {
  const bool estimated = f.estimate * scale > fp_max;
  const bool unknown = resolve == Resolve::kEstimate ? estimated : resolve == Resolve::kOverflow;
  switch (f.kind) {
    case Known::kOverflow: return true;
    // The estimate also carries the overflow inside backward that the recording implies.
    case Known::kMagnitude: return resolve == Resolve::kEstimate ? estimated : f.magnitude * scale > fp_max;
    case Known::kFiniteUpTo: return scale <= f.scale ? false : unknown;
    case Known::kOverflowFrom: return scale >= f.scale ? true : unknown;
  }
  return unknown;
}

// torch.amp.GradScaler's update (torch._amp_update_scale_), with the optional floor.
ScalerReplay replay(const std::vector<StepFacts>& facts, const ScalerConfig& c, double fp_max, Resolve unknown) {
  ScalerReplay r;
  double scale = c.init_scale;
  std::int64_t tracker = 0;
  r.lowest_scale = scale;
  for (const auto& f : facts) {
    r.scales.push_back(scale);
    r.lowest_scale = std::min(r.lowest_scale, scale);
    const bool skip = overflows(f, scale, fp_max, unknown);
    r.skips.push_back(skip);
    if (skip) {
      ++r.skipped;
      scale = std::max(scale * c.backoff_factor, c.min_scale);
      tracker = 0;
    } else if (++tracker == c.growth_interval) {
      if (std::isfinite(scale * c.growth_factor)) scale *= c.growth_factor;
      tracker = 0;
    }
  }
  r.final_scale = scale;
  // The calibration as the report counts it (a step NaN/Inf at any scale is not the scale's doing).
  const auto at = [&](std::size_t i) {
    return ScaleStep{r.skips[i], r.scales[i], i + 1 < r.scales.size() ? r.scales[i + 1] : r.final_scale};
  };
  const std::size_t end = calibration_end(facts.size(), at);
  for (std::size_t i = 0; i < end; ++i)
    r.calibration += is_calibration(at(i), i, end) && facts[i].kind != Known::kOverflow && facts[i].settles;
  return r;
}

// fp16 rounds |x| < 2^-25 to zero (2^-25 itself ties to even: zero; above it rounds up to
// 2^-24, the smallest subnormal). Bin b >= 1 holds 2^e <= |x| < 2^(e+1), e = kHistMinExp + b - 1;
// bin 0 everything below 2^kHistMinExp.
double underflow_share(const Run& run, const ScalerReplay& r, const StepHistograms& histograms) {
  double flushed = 0, total = 0;
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    if (r.skips[i]) continue;
    const auto h = histograms.find(run.steps[i].row.step);
    if (h == histograms.end() || h->second.size() != std::size_t(rundb::kHistBins)) continue;
    const double shift = std::log2(r.scales[i] / run.steps[i].row.scale_before);
    for (int b = 0; b < rundb::kHistBins; ++b) {
      const double count = double(h->second[std::size_t(b)]);
      total += count;
      // The top of the bin after the shift: below 2^-25 every value in it flushes.
      const double top = b == 0 ? rundb::kHistMinExp + shift : rundb::kHistMinExp + (b - 1) + 1 + shift;
      if (b < rundb::kHistBins - 1 && top <= -25.0) flushed += count;
    }
  }
  return total > 0 ? flushed / total : -1.0;
}

std::string number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

}  // namespace

void ScalerConfig::check() const {
  if (!(init_scale > 0) || !std::isfinite(init_scale)) throw std::invalid_argument("--init-scale must be a positive finite number");
  if (!(growth_factor > 1) || !std::isfinite(growth_factor)) throw std::invalid_argument("--growth-factor must be above 1");
  if (!(backoff_factor > 0 && backoff_factor < 1)) throw std::invalid_argument("--backoff-factor must be between 0 and 1");
  if (growth_interval < 1) throw std::invalid_argument("--growth-interval must be a positive number of steps");
  if (!(min_scale >= 0) || !std::isfinite(min_scale)) throw std::invalid_argument("--min-scale must be 0 (none) or positive");
}

std::string ScalerConfig::describe() const {
  return "init " + number(init_scale) + ", growth " + number(growth_factor) + " every " + std::to_string(growth_interval) +
         ", backoff " + number(backoff_factor) + (min_scale > 0 ? ", floor " + number(min_scale) : std::string());
}

ScalerConfig recorded_config(const Run& run) {
  ScalerConfig c;
  auto real = [&](const char* key, double fallback) {
    const std::string v = run.meta_or(key, "");
    return v.empty() ? fallback : std::atof(v.c_str());
  };
  c.init_scale = real("scaler_init_scale", c.init_scale);
  c.growth_factor = real("scaler_growth_factor", c.growth_factor);
  c.backoff_factor = real("scaler_backoff_factor", c.backoff_factor);
  c.growth_interval = std::int64_t(real("scaler_growth_interval", double(c.growth_interval)));
  return c;
}

StepHistograms read_step_histograms(const std::string& path) {
  StepHistograms out;
  rundb::RunDbReader reader(path);
  reader.for_each_grad_stat([&](const rundb::GradStatRow& g) {
    if (g.histogram.empty() || g.stats.nan + g.stats.inf > 0) return;
    auto& sum = out[g.step];
    sum.resize(rundb::kHistBins, 0);
    for (int b = 0; b < rundb::kHistBins; ++b) sum[std::size_t(b)] += g.histogram[std::size_t(b)];
  });
  return out;
}

WhatIf what_if(const Run& run, const ScalerConfig& config, const StepHistograms* histograms) {
  if (!run.has_scaler())
    throw std::invalid_argument(run.path + " was recorded without a loss scaler (bf16): there is no loss scaler to replay");
  config.check();
  WhatIf w;
  w.config = config;
  w.steps = std::int64_t(run.steps.size());
  std::vector<StepFacts> facts = facts_of(run, w);
  estimate_unknown(facts, run.fp_max);
  w.estimate = replay(facts, config, run.fp_max, Resolve::kEstimate);
  w.optimistic = replay(facts, config, run.fp_max, Resolve::kFinite);
  w.pessimistic = replay(facts, config, run.fp_max, Resolve::kOverflow);
  for (std::size_t i = 0; i < facts.size(); ++i)
    if (w.optimistic.skips[i] != w.pessimistic.skips[i]) w.uncertain_steps.push_back(run.steps[i].row.step);
  if (histograms && !histograms->empty()) w.underflow = underflow_share(run, w.estimate, *histograms);
  return w;
}

std::vector<WhatIf> search_configs(const Run& run, const StepHistograms* histograms) {
  std::vector<WhatIf> out;
  for (double init : {1024.0, 8192.0, 65536.0, 1048576.0})
    for (std::int64_t interval : {100, 500, 2000})
      for (double backoff : {0.5, 0.25}) {
        ScalerConfig c;
        c.init_scale = init;
        c.growth_interval = interval;
        c.backoff_factor = backoff;
        out.push_back(what_if(run, c, histograms));
      }
  std::stable_sort(out.begin(), out.end(), [](const WhatIf& a, const WhatIf& b) {
    if (a.estimate.steady() != b.estimate.steady()) return a.estimate.steady() < b.estimate.steady();
    if (a.underflow != b.underflow) return a.underflow < b.underflow;
    if (a.pessimistic.steady() != b.pessimistic.steady()) return a.pessimistic.steady() < b.pessimistic.steady();
    if (a.estimate.skipped != b.estimate.skipped) return a.estimate.skipped < b.estimate.skipped;
    return a.estimate.lowest_scale > b.estimate.lowest_scale;
  });
  return out;
}

// Skips saved only in the calibration are no reason to change a scaler: it happens once.
bool improves_on(const WhatIf& candidate, const WhatIf& recorded) {
  if (candidate.estimate.steady() != recorded.estimate.steady())
    return candidate.estimate.steady() < recorded.estimate.steady();
  if (candidate.underflow >= 0 && recorded.underflow >= 0 && candidate.underflow != recorded.underflow)
    return candidate.underflow < recorded.underflow;
  return candidate.pessimistic.steady() < recorded.pessimistic.steady();
}

bool recommends(const Run& run, const WhatIf& best, const WhatIf& recorded) {
  return improves_on(best, recorded) && !rules::find_divergence(run).found;
}

std::string recommendation(const Run& run, const WhatIf& best, const WhatIf& recorded, std::size_t searched) {
  // The replay takes the gradients as given: where the run's own loop made them grow
  // without bound, no scaler setting is the fix, whatever the replay predicts.
  if (const rules::Divergence d = rules::find_divergence(run); d.found)
    return "keep the recorded configuration: the loss diverged (it grew " + d.factor() + " from step " +
           std::to_string(d.rise) + " before its NaN/Inf), and no scaler setting fixes that: see ampdiag report "
           "(loss-divergence)";
  if (improves_on(best, recorded)) return grad_scaler_call(run, best.config);
  std::string why = "keep the recorded configuration: none of the " + std::to_string(searched) +
                    " searched is predicted to skip fewer steps";
  if (recorded.estimate.calibration > 0)
    why += " once the scale has come down to where the gradients fit (the recorded one skipped " +
           std::to_string(recorded.estimate.calibration) + (recorded.estimate.calibration == 1 ? " step" : " steps") +
           " coming down from init_scale " + number(recorded.config.init_scale) + ", which happens once a run)";
  if (recorded.always_skipped > 0)
    why += " (" + std::to_string(recorded.always_skipped) + " of its " + std::to_string(recorded.estimate.skipped) +
           " skips were NaN/Inf whatever the scale, made in forward, in the loss's backward or in the parameters: "
           "see ampdiag report)";
  return why;
}

std::int64_t recorded_skips(const Run& run) {
  std::int64_t skipped = 0;
  for (const auto& s : run.steps) skipped += s.row.skipped ? 1 : 0;
  return skipped;
}

std::string grad_scaler_call(const Run& run, const ScalerConfig& c) {
  const std::string device = run.meta_or("device", "cuda").rfind("cpu", 0) == 0 ? "cpu" : "cuda";
  return "torch.amp.GradScaler(\"" + device + "\", init_scale=" + number(c.init_scale) +
         ", growth_factor=" + number(c.growth_factor) + ", backoff_factor=" + number(c.backoff_factor) +
         ", growth_interval=" + std::to_string(c.growth_interval) + ")";
}

std::vector<std::string> whatif_lines(const Run& run) {
  if (!run.has_scaler() || !run.fp16()) return {};
  const ScalerConfig recorded = recorded_config(run);
  const WhatIf as_recorded = what_if(run, recorded);
  const std::vector<WhatIf> grid = search_configs(run);
  if (grid.empty()) return {};
  const WhatIf& best = grid.front();
  std::string bounds;
  if (best.optimistic.skipped != best.pessimistic.skipped)
    bounds = " (bounds " + std::to_string(best.optimistic.skipped) + " to " + std::to_string(best.pessimistic.skipped) + ")";
  return {"recorded with " + recorded.describe() + ": " + std::to_string(recorded_skips(run)) + " skipped",
          "best of " + std::to_string(grid.size()) + ": " + best.config.describe() + ": " +
              std::to_string(best.estimate.skipped) + " skips" + bounds + ", lowest scale " +
              number(best.estimate.lowest_scale),
          recommendation(run, best, as_recorded, grid.size())};
}

}  // namespace ampdiag::analyzer
