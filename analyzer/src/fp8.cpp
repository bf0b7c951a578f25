// fp8_readiness(); see fp8.h.
#include "ampdiag/analyzer/fp8.h"

#include <algorithm>
#include <cmath>
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

struct Sums {
  double normal[2] = {}, below[2] = {}, above[2] = {}, total = 0;
  std::int64_t steps = 0, saturated[2] = {};
};

double step_scale(const Run& run, std::int64_t step) {
  // run.steps is in step order; steps start at 0 and rarely miss one.
  const auto it = std::lower_bound(run.steps.begin(), run.steps.end(), step,
                                   [](const StepSummary& s, std::int64_t v) { return s.row.step < v; });
  return it != run.steps.end() && it->row.step == step ? it->row.scale_before : 0.0;
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
  std::vector<History> history(run.layers.size());
  for (std::size_t i = 0; i < run.layers.size(); ++i)
    for (const GradSample& s : run.layers[i].samples) {
      history[i].steps.push_back(s.step);
      history[i].amax.push_back(s.nonfinite ? -1.0 : double(s.absmax) / step_scale(run, s.step));
    }
  std::map<std::int64_t, Sums> sums;
  rundb::RunDbReader reader(run.path);
  reader.for_each_grad_stat([&](const rundb::GradStatRow& g) {
    if (g.histogram.empty() || g.stats.nan + g.stats.inf > 0 || g.layer_id < 0 ||
        std::size_t(g.layer_id) >= run.layers.size())
      return;
    const double recorded_scale = step_scale(run, g.step);
    if (!(recorded_scale > 0) || !(g.stats.absmax > 0)) return;
    // Delayed scaling: the largest unscaled |g| of the previous `history` finite samples
    // (this step's own when there are none yet), to a power-of-two scale.
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
    if (seen == 0) amax = current;
    Sums& s = sums[g.layer_id];
    ++s.steps;
    for (int f = 0; f < 2; ++f) {
      const Fp8Format& fmt = kFormats[f];
      const int top_exp = int(std::floor(std::log2(fmt.max)));
      // The scale maps the history's amax into the top binade (power of two: binades map
      // onto binades exactly), then `margin_bits` lower.
      const int scale_exp = int(std::floor(std::log2(fmt.max / amax))) - options.margin_bits;
      const double fp8_scale = std::ldexp(1.0, scale_exp);
      if (current * fp8_scale > fmt.max) ++s.saturated[f];
      // A recorded value in binade e (at the recorded scale) lands in binade e + shift.
      const int shift = int(std::floor(std::log2(fp8_scale / recorded_scale)));
      for (int b = 0; b < rundb::kHistBins; ++b) {
        const double count = double(g.histogram[std::size_t(b)]);
        if (count == 0) continue;
        const int e = b == 0 ? rundb::kHistMinExp - 1 : rundb::kHistMinExp + b - 1;
        const int landed = e + shift;
        if (landed < fmt.min_normal_exp) s.below[f] += count;
        else if (landed > top_exp) s.above[f] += count;
        else s.normal[f] += count;
      }
    }
    for (const auto c : g.histogram) s.total += double(c);
  });
  for (const auto& [layer, s] : sums) {
    if (s.total <= 0) continue;
    Fp8Layer l;
    l.layer = run.layers[std::size_t(layer)].info.name;
    l.steps = s.steps;
    for (int f = 0; f < 2; ++f) {
      l.shares[f] = {s.normal[f] / s.total, s.below[f] / s.total, s.above[f] / s.total};
      l.saturated_steps[f] = s.saturated[f];
      l.fits[f] = l.shares[f].normal >= options.fit_share;
    }
    out.layers.push_back(std::move(l));
  }
  std::stable_sort(out.layers.begin(), out.layers.end(), [](const Fp8Layer& a, const Fp8Layer& b) {
    if (a.shares[1].normal != b.shares[1].normal) return a.shares[1].normal < b.shares[1].normal;
    return a.shares[0].normal < b.shares[0].normal;
  });
  return out;
}

void add_fp8_overview(Report& report, const std::vector<Run>& runs, const Fp8Options& options) {
  constexpr std::size_t kListed = 3;
  for (std::size_t i = 0; i < runs.size() && i < report.runs.size(); ++i) {
    const Fp8Readiness r = fp8_readiness(runs[i], options);
    if (!r.histograms) continue;
    Fp8Overview& o = report.runs[i].fp8;
    o.recorded = true;
    o.history = options.history;
    o.fit_share = options.fit_share;
    o.layers = std::int64_t(r.layers.size());
    std::vector<const Fp8Layer*> unfit;
    for (const auto& l : r.layers) {
      o.fit_e4m3 += l.fits[0];
      o.fit_e5m2 += l.fits[1];
      if (!l.fits[0]) unfit.push_back(&l);
    }
    std::stable_sort(unfit.begin(), unfit.end(), [](const Fp8Layer* a, const Fp8Layer* b) {
      return a->shares[0].normal < b->shares[0].normal;
    });
    for (std::size_t k = 0; k < unfit.size() && k < kListed; ++k)
      o.least_ready.push_back({unfit[k]->layer, unfit[k]->shares[0].normal, unfit[k]->shares[1].normal});
  }
}

}  // namespace ampdiag::analyzer
