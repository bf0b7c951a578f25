// precision-loss: a module whose output in fp16/bf16 is far from the same call run in FP32,
// while every value stays finite. Nothing else in a run shows it: no NaN, no skipped step,
// the loss scale steady, and a norm whose x.pow(2) overflowed inside it hands on zeros.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

struct ModuleChecks {
  std::int64_t checks = 0;
  std::vector<double> errors;           // every check's relative error
  std::vector<std::int64_t> lossy_steps;  // the steps of the checks above the threshold
  double zeroed = 0.0;                  // the largest share of values zeroed in one check
  double fp32_absmax = 0.0;             // the largest FP32 output
  std::string dtype;                    // as it ran (the last check's)
};

std::string percent(double share) {
  char buf[32];
  std::snprintf(buf, sizeof buf, share >= 0.1 ? "%.0f %%" : share >= 0.001 ? "%.1f %%" : "%.2g %%", share * 100.0);
  return buf;
}

}  // namespace

void precision_loss(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  std::map<std::string, ModuleChecks> by_module;
  for (const auto& c : run.precision_checks) {
    ModuleChecks& m = by_module[c.module];
    ++m.checks;
    m.errors.push_back(c.rel_error);
    if (c.rel_error >= t.precision_error) m.lossy_steps.push_back(c.step);
    m.zeroed = std::max(m.zeroed, double(c.zeroed) / double(c.numel));
    m.fp32_absmax = std::max(m.fp32_absmax, c.fp32_absmax);
    m.dtype = c.dtype;
  }
  // Lossy in at least half its checks: one check that lands on a near tie (a routing
  // decision flipped by rounding) does not name a module.
  // Checks made while weights inside the module were too small for float16 are flushed-weights'.
  const std::vector<FlushedLayer> flushed = flushed_layers(run);
  const auto explained = [&](const std::string& path, const ModuleChecks& m) {
    return std::all_of(m.lossy_steps.begin(), m.lossy_steps.end(),
                       [&](std::int64_t step) { return flushed_at(flushed, path, step); });
  };
  std::vector<std::string> lossy;
  for (const auto& [path, m] : by_module)
    if (!m.lossy_steps.empty() && 2 * std::int64_t(m.lossy_steps.size()) >= m.checks && !explained(path, m))
      lossy.push_back(path);
  for (const std::string& path : lossy) {
    // A lossy module inside it is where the loss is made; it only hands the loss on.
    const auto inside = [&](const std::string& other) { return other != path && suggest::within(other, path); };
    if (std::any_of(lossy.begin(), lossy.end(), inside)) continue;
    const ModuleChecks& m = by_module.at(path);
    std::vector<double> errors = m.errors;
    const double median = median_of(errors);
    std::vector<double> others;
    for (const auto& [other, o] : by_module)
      if (other != path && std::find(lossy.begin(), lossy.end(), other) == lossy.end())
        others.insert(others.end(), o.errors.begin(), o.errors.end());
    Finding f;
    f.rule = "precision-loss";
    f.severity = median >= 0.5 ? Severity::kError : Severity::kWarning;
    f.module = path;
    f.steps = m.lossy_steps;
    f.score = 2.0 + median;
    f.confirmation = "confirmed";  // the FP32 output compared with is what the pin gives
    const std::string precision = run.meta_or("amp_dtype", "float16");
    f.title = path + " loses its output to " + precision + ": " + percent(median) +
              " away from the same call in FP32, without NaN/Inf";
    f.evidence = "in " + std::to_string(m.lossy_steps.size()) + " of " + plural(m.checks, "check") + " (step" +
                 (m.lossy_steps.size() == 1 ? " " : "s ") + step_list(m.lossy_steps, 4) +
                 ") the same call run again in FP32, on copies of its inputs, gave an output " + percent(median) +
                 " (median, relative L2) away from its " + m.dtype + " output as it ran";
    if (!others.empty())
      f.evidence += "; the other checked modules were " + percent(median_of(others)) + " away (median), rounding alone";
    if (m.zeroed >= 0.01)
      f.evidence += "; up to " + percent(m.zeroed) + " of its values came out exactly 0 where FP32's were not (an "
                    "intermediate inside it overflowed or underflowed" +
                    (run.fp16() ? std::string(": x.pow(2) beyond 65504 makes rsqrt() 0)") : std::string(")"));
    // bf16 keeps fp32's range but not its precision: only the pin restores what FP32 gives,
    // unless that output itself is beyond fp16 (then the pin moves an overflow on).
    f.suggestions = suggest::beyond_fp16(run, m.fp32_absmax) ? suggest::confirmed_fixes(run, path, m.fp32_absmax)
                                                             : std::vector<Suggestion>{suggest::pin_fp32(run, path)};
    out.push_back(std::move(f));
  }
}

}  // namespace ampdiag::analyzer::rules
