// fp8_readiness(); see fp8.h.
#include "ampdiag/analyzer/fp8.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <map>
#include <stdexcept>

#include "ampdiag/rundb/reader.h"

namespace ampdiag::analyzer {

namespace {

constexpr Fp8Format kFormats[2] = {kE4M3, kE5M2};

// The layer's amax history: the unscaled largest |g| of each of its samples, in step
// order (negative for a non-finite one), unscaled once rather than per row that reads it.
struct History {
  std::vector<std::int64_t> steps;
  std::vector<double> amax;
  std::size_t next = 0;  // the first sample at or after the current step
};

// One tensor's (a layer's gradient, a module's output) rows, placed in each format.
struct Sums {
  double normal[2] = {}, below[2] = {}, above[2] = {}, total = 0;
  std::int64_t steps = 0, saturated[2] = {};
  // Steps are counted once however many rows (a module's calls) they have.
  std::int64_t last_step = -1, last_saturated[2] = {-1, -1};

  // One finite row of `step`: its histogram recorded at `recorded_scale`, scaled for FP8
  // from the history's `amax`; `current` is the row's own unscaled largest |x|.
  void add(std::int64_t step, const std::vector<std::uint32_t>& histogram, double recorded_scale, double amax,
           double current, const Fp8Options& options) {
    if (step != last_step) ++steps, last_step = step;
    for (int f = 0; f < 2; ++f) {
      const Fp8Format& fmt = kFormats[f];
      const int top_exp = int(std::floor(std::log2(fmt.max)));
      // The scale maps the history's amax into the top binade (power of two: binades map
      // onto binades exactly), then `margin_bits` lower.
      const int scale_exp = int(std::floor(std::log2(fmt.max / amax))) - options.margin_bits;
      const double fp8_scale = std::ldexp(1.0, scale_exp);
      if (current * fp8_scale > fmt.max && last_saturated[f] != step) ++saturated[f], last_saturated[f] = step;
      // A recorded value in binade e (at the recorded scale) lands in binade e + shift.
      const int shift = int(std::floor(std::log2(fp8_scale / recorded_scale)));
      for (int b = 0; b < rundb::kHistBins; ++b) {
        const double count = double(histogram[std::size_t(b)]);
        if (count == 0) continue;
        const int e = b == 0 ? rundb::kHistMinExp - 1 : rundb::kHistMinExp + b - 1;
        const int landed = e + shift;
        if (landed < fmt.min_normal_exp) below[f] += count;
        else if (landed > top_exp) above[f] += count;
        else normal[f] += count;
      }
    }
    for (const auto c : histogram) total += double(c);
  }

  bool judged() const { return total > 0; }
  Fp8Layer result(std::string name, const Fp8Options& options) const {
    Fp8Layer l;
    l.name = std::move(name);
    l.steps = steps;
    for (int f = 0; f < 2; ++f) {
      l.shares[f] = {normal[f] / total, below[f] / total, above[f] / total};
      l.saturated_steps[f] = saturated[f];
      l.fits[f] = l.shares[f].normal >= options.fit_share;
    }
    return l;
  }
};

// Activations' delayed scaling: a module's amax history holds one value per recorded step,
// the largest |x| of its calls that step (a step with a non-finite call has none); every
// call of a step is scaled from the steps before it.
struct ModuleHistory {
  std::deque<double> amax;  // the last `history` finite steps, oldest first
  std::int64_t step = -1;   // the step being read
  double step_max = 0;
  bool step_finite = true;

  void begin(std::int64_t s, std::int64_t history) {
    if (s == step) return;
    if (step >= 0 && step_finite && step_max > 0) {
      amax.push_back(step_max);
      if (std::int64_t(amax.size()) > history) amax.pop_front();
    }
    step = s;
    step_max = 0;
    step_finite = true;
  }
};

double step_scale(const Run& run, std::int64_t step) {
  const StepSummary* s = run.step_summary(step);
  return s ? s->row.scale_before : 0.0;
}

// Least E5M2-ready first, then least E4M3-ready; those with histograms but never a finite
// one to judge go to `unjudged`.
std::vector<Fp8Layer> ranked(const std::map<std::int64_t, Sums>& sums,
                             const std::function<std::string(std::int64_t)>& name, const Fp8Options& options,
                             std::vector<std::string>& unjudged) {
  std::vector<Fp8Layer> out;
  for (const auto& [id, s] : sums) {
    if (s.judged())
      out.push_back(s.result(name(id), options));
    else
      unjudged.push_back(name(id));
  }
  std::stable_sort(out.begin(), out.end(), [](const Fp8Layer& a, const Fp8Layer& b) {
    if (a.shares[1].normal != b.shares[1].normal) return a.shares[1].normal < b.shares[1].normal;
    return a.shares[0].normal < b.shares[0].normal;
  });
  return out;
}

void gradient_readiness(const Run& run, rundb::RunDbReader& reader, const Fp8Options& options, Fp8Readiness& out) {
  std::vector<History> history(run.layers.size());
  for (std::size_t i = 0; i < run.layers.size(); ++i)
    for (const GradSample& s : run.layers[i].samples) {
      history[i].steps.push_back(s.step);
      history[i].amax.push_back(s.nonfinite ? -1.0 : double(s.absmax) / step_scale(run, s.step));
    }
  std::map<std::int64_t, Sums> sums;
  reader.for_each_grad_stat([&](const rundb::GradStatRow& g) {
    if (g.histogram.empty() || g.layer_id < 0 || std::size_t(g.layer_id) >= run.layers.size()) return;
    Sums& s = sums[g.layer_id];
    if (g.stats.nan + g.stats.inf > 0) return;
    const double recorded_scale = step_scale(run, g.step);
    if (!(recorded_scale > 0) || !(g.stats.absmax > 0)) return;
    // Delayed scaling: the largest unscaled |g| of the previous `history` finite samples
    // (this step's own when there are none yet).
    History& h = history[std::size_t(g.layer_id)];
    while (h.next < h.steps.size() && h.steps[h.next] < g.step) ++h.next;
    double amax = 0;
    std::int64_t seen = 0;
    for (std::size_t k = h.next; k-- > 0 && seen < options.history;) {
      if (h.amax[k] < 0) continue;
      amax = std::max(amax, h.amax[k]);
      ++seen;
    }
    const double current = g.stats.absmax / recorded_scale;
    s.add(g.step, g.histogram, recorded_scale, seen == 0 ? current : amax, current, options);
  });
  out.layers = ranked(
      sums, [&](std::int64_t id) { return run.layers[std::size_t(id)].info.name; }, options, out.unjudged_layers);
}

void activation_readiness(const Run& run, rundb::RunDbReader& reader, const Fp8Options& options, Fp8Readiness& out) {
  std::map<std::int64_t, ModuleHistory> history;
  std::map<std::int64_t, Sums> sums;
  // Rows come in (step, fwd_order) order: a module's step is whole before its next begins.
  reader.for_each_act_stat([&](const rundb::ActStatRow& a) {
    if (a.module_id < 0 || std::size_t(a.module_id) >= run.modules.size()) return;
    ModuleHistory& h = history[a.module_id];
    h.begin(a.step, options.history);
    const bool finite = a.stats.nan + a.stats.inf == 0;
    h.step_finite = h.step_finite && finite;
    if (finite) h.step_max = std::max(h.step_max, a.stats.absmax);
    if (a.histogram.empty()) return;
    out.activation_histograms = true;
    Sums& s = sums[a.module_id];
    if (!finite || !(a.stats.absmax > 0)) return;
    // Forward values carry no loss scale: recorded at scale 1.
    double amax = 0;
    for (const double v : h.amax) amax = std::max(amax, v);
    s.add(a.step, a.histogram, 1.0, amax > 0 ? amax : a.stats.absmax, a.stats.absmax, options);
  });
  out.activations = ranked(
      sums, [&](std::int64_t id) { return run.modules[std::size_t(id)].info.path; }, options, out.unjudged_modules);
}

Fp8Overview::Group overview_group(const std::vector<Fp8Layer>& tensors) {
  constexpr std::size_t kListed = 3;
  Fp8Overview::Group g;
  g.count = std::int64_t(tensors.size());
  std::vector<const Fp8Layer*> unfit;
  for (const auto& l : tensors) {
    g.fit_e4m3 += l.fits[0];
    g.fit_e5m2 += l.fits[1];
    if (!l.fits[0]) unfit.push_back(&l);
  }
  std::stable_sort(unfit.begin(), unfit.end(),
                   [](const Fp8Layer* a, const Fp8Layer* b) { return a->shares[0].normal < b->shares[0].normal; });
  for (std::size_t k = 0; k < unfit.size() && k < kListed; ++k)
    g.least_ready.push_back({unfit[k]->name, unfit[k]->shares[0].normal, unfit[k]->shares[1].normal});
  return g;
}

}  // namespace

void Fp8Options::check() const {
  if (history < 1) throw std::invalid_argument("--history must be at least 1 step");
  if (margin_bits < 0 || margin_bits > 32) throw std::invalid_argument("--margin must be between 0 and 32 binades");
  if (!(fit_share > 0 && fit_share <= 1)) throw std::invalid_argument("--fit-share must be in (0, 1]");
}

Fp8Readiness fp8_readiness(const Run& run, const Fp8Options& options) {
  options.check();
  Fp8Readiness out;
  out.options = options;
  out.histograms = run.meta_or("histogram", "0") == "1";
  if (!out.histograms) return out;
  rundb::RunDbReader reader(run.path);
  gradient_readiness(run, reader, options, out);
  activation_readiness(run, reader, options, out);
  return out;
}

void add_fp8_overview(Report& report, const std::vector<Run>& runs, const Fp8Options& options) {
  for (std::size_t i = 0; i < runs.size() && i < report.runs.size(); ++i) {
    const Fp8Readiness r = fp8_readiness(runs[i], options);
    if (!r.histograms) continue;
    Fp8Overview& o = report.runs[i].fp8;
    o.recorded = true;
    o.history = options.history;
    o.fit_share = options.fit_share;
    o.gradients = overview_group(r.layers);
    o.activations_recorded = r.activation_histograms;
    o.activations = overview_group(r.activations);
  }
}

}  // namespace ampdiag::analyzer
