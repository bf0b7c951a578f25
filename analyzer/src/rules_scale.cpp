// scale-collapse and skip-rate: what the loss-scale timeline says.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "calibration.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

std::string three_digits(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

std::string replay_absmax(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string fmt(double v) {
  char b[32];
  // A loss scale is a power of two, set as one (init_scale=2**24): "%g" would print
  // 16777216 as 1.67772e+07, which is not the number the user wrote.
  int exponent = 0;
  const bool whole_power_of_two = v >= 1.0 && v < 9007199254740992.0 && std::frexp(v, &exponent) == 0.5;
  std::snprintf(b, sizeof b, whole_power_of_two ? "%.0f" : "%g", v);
  return b;
}

double median_of(std::vector<double>& values) {
  if (values.empty()) return NAN;
  const auto mid = values.begin() + std::ptrdiff_t(values.size() / 2);
  std::nth_element(values.begin(), mid, values.end());
  return *mid;
}

std::map<std::int64_t, double> scales_before(const Run& run) {
  std::map<std::int64_t, double> scales;
  for (const auto& s : run.steps) scales[s.row.step] = s.row.scale_before;
  return scales;
}

std::string plural(std::int64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string pct(double share) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f%%", share * 100.0);
  return b;
}

bool ends_with(const std::string& text, const std::string& end) {
  return text.size() >= end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
}

std::string step_list(const std::vector<std::int64_t>& steps, std::size_t limit) {
  std::string s;
  for (std::size_t i = 0; i < steps.size() && i < limit; ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  if (steps.size() > limit) s += ", ...";
  return s;
}

namespace {

ScaleStep scale_step(const Run& run, std::size_t i) {
  const auto& row = run.steps[i].row;
  return {row.skipped, row.scale_before, row.scale_after};
}

}  // namespace

std::size_t calibration_end(const Run& run) {
  return analyzer::calibration_end(run.steps.size(), [&](std::size_t i) { return scale_step(run, i); });
}

bool is_calibration(const Run& run, std::size_t i, std::size_t end) {
  return analyzer::is_calibration(scale_step(run, i), i, end);
}

std::int64_t calibration_skips(const Run& run) {
  const std::size_t end = calibration_end(run);
  std::int64_t n = 0;
  for (std::size_t i = 0; i < end; ++i) n += is_calibration(run, i, end);
  return n;
}

bool is_growth_probe(const Run& run, std::size_t i) {
  return i > 0 && run.steps[i].row.skipped && run.steps[i].row.scale_before > run.steps[i - 1].row.scale_before;
}

namespace {

// Optimizer steps taken in a row at `scale` just before step `probe`.
std::size_t held_before(const Run& run, std::size_t probe, double scale) {
  std::size_t held = 0;
  for (std::size_t j = probe; j-- > 0 && !run.steps[j].row.skipped && run.steps[j].row.scale_before == scale;) ++held;
  return held;
}

}  // namespace

bool answers_growth_probe(const Run& run, std::size_t i) {
  if (!run.steps[i].row.skipped) return false;
  // Back through the skips that halved the scale, each at a scale it had not rested at
  // before the probe that began them.
  std::vector<double> scales;
  for (std::size_t k = i; k > 0; --k) {
    const auto& row = run.steps[k].row;
    const auto& before = run.steps[k - 1].row;
    if (!before.skipped || !(row.scale_before < before.scale_before)) return false;
    scales.push_back(row.scale_before);
    if (is_growth_probe(run, k - 1)) {
      for (const double scale : scales)
        if (held_before(run, k - 1, scale) >= kSettledSteps) return false;
      return true;
    }
  }
  return false;
}

std::vector<bool> harmful_skip_mask(const Run& run) {
  const std::size_t end = calibration_end(run);
  std::vector<bool> harmful(run.steps.size());
  for (std::size_t i = 0; i < run.steps.size(); ++i)
    harmful[i] = run.steps[i].row.skipped && !is_calibration(run, i, end) && !is_growth_probe(run, i) &&
                 !answers_growth_probe(run, i);
  return harmful;
}

std::int64_t harmful_skips(const Run& run) {
  const auto harmful = harmful_skip_mask(run);
  return std::count(harmful.begin(), harmful.end(), true);
}

double harmful_skip_rate(const Run& run) {
  const std::int64_t considered = std::int64_t(run.steps.size()) - calibration_skips(run);
  return considered > 0 ? double(harmful_skips(run)) / double(considered) : 1.0;
}

bool scale_collapsed(const Run& run, const Thresholds& t) {
  for (const auto& s : run.steps)
    if (s.row.scale_after < t.scale_floor) return true;
  return calibration_skips(run) == std::int64_t(run.steps.size());
}

bool overflow_hurts(const Run& run, const Thresholds& t) {
  return scale_collapsed(run, t) || harmful_skip_rate(run) > t.skip_rate;
}

void scale_collapse(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  if (!run.has_scaler()) return;  // bf16 without a scaler: the "scale" is a constant 1
  double lowest = INFINITY;
  std::int64_t lowest_step = -1, below = 0, first_below = -1, backoffs = 0;
  for (const auto& s : run.steps) {
    if (s.row.scale_after < lowest) {
      lowest = s.row.scale_after;
      lowest_step = s.row.step;
    }
    if (s.row.scale_after < t.scale_floor) {
      ++below;
      if (first_below < 0) first_below = s.row.step;
    }
    backoffs += s.row.scale_after < s.row.scale_before;
  }
  std::int64_t harmful_backoffs = 0;  // neither the initial calibration nor answers to growth probes
  const std::size_t end = calibration_end(run);
  for (std::size_t i = 0; i < run.steps.size(); ++i)
    harmful_backoffs += run.steps[i].row.scale_after < run.steps[i].row.scale_before && !is_calibration(run, i, end) &&
                        !is_growth_probe(run, i) && !answers_growth_probe(run, i);
  const double first = run.steps.front().row.scale_before, last = run.steps.back().row.scale_after;
  // Still falling: the scale ends at its lowest after at least `backoff_run` back-offs that
  // were not the initial calibration, and is within 4 bits (16x) of the floor. A scale that
  // settles well above the floor is the scaler working.
  // A scale that never backed off in this recording did not collapse here: it started low
  // (a low init_scale, or a scale restored from a checkpoint) and nothing overflowed. Once
  // the scaler has grown it past the floor, it did its job; until then it is a warning:
  // small gradients may flush to zero (underflow says where), but no evidence of harm.
  const bool started_low = backoffs == 0;
  if (started_low && last >= t.scale_floor) return;
  const bool collapsed = below > 0;
  const bool falling = !collapsed && last == lowest && last < first && harmful_backoffs >= t.backoff_run &&
                       last < t.scale_floor * 16.0;
  if (!collapsed && !falling) return;
  Finding f;
  f.rule = "scale-collapse";
  f.severity = collapsed && !started_low ? Severity::kError : Severity::kWarning;
  f.score = started_low ? 40.0 : 100.0;
  if (started_low)
    f.title = "The loss scale is " + fmt(first) + (first < 1.0 ? ", below 1," : ", below the floor of " + fmt(t.scale_floor) + ",") +
              " from the first step and has not grown: " +
              (first < 1.0 ? "fp16 gradients are shrunk, not protected" : "small fp16 gradients are barely protected");
  else if (lowest < 1.0)
    f.title = "The loss scale fell below 1 (" + fmt(lowest) + "): fp16 gradients are being shrunk, not protected";
  else if (collapsed)
    f.title = "The loss scale collapsed to " + fmt(lowest) + ", below the floor of " + fmt(t.scale_floor);
  else
    f.title = "The loss scale keeps backing off towards the floor of " + fmt(t.scale_floor) + " (now " + fmt(last) + ")";
  f.evidence = "scale " + fmt(first) + " at step " + std::to_string(run.steps.front().row.step) + ", lowest " + fmt(lowest) +
               " at step " + std::to_string(lowest_step) + ", now " + fmt(last) + "; " + plural(backoffs, "back-off");
  if (collapsed) f.evidence += ", " + plural(below, "step") + " below " + fmt(t.scale_floor);
  bool stuck = run.steps.size() >= 4;
  for (std::size_t i = run.steps.size() >= 4 ? run.steps.size() - 4 : 0; i < run.steps.size(); ++i)
    stuck = stuck && run.steps[i].row.scale_after == lowest;
  if (stuck) f.evidence += "; it has stayed at its lowest value for the last steps";
  if (first_below >= 0) f.steps.push_back(first_below);
  if (backoffs == 0) {
    // Below the floor without ever backing off: it started there and never grew.
    f.evidence += "; no step overflowed: the scaler started low (a low init_scale, or a scale restored with "
                  "scaler.load_state_dict()) and has not grown yet";
    f.suggestions.push_back(suggest::scaler_settings(
        run, std::max(65536.0, first), std::min<std::int64_t>(2000, std::max<std::int64_t>(100, std::int64_t(run.steps.size()) / 4)),
        "Start the scaler higher (torch's default init_scale is 65536; after loading a checkpoint's scaler state, its "
        "\"scale\" entry) or let it grow sooner."));
  } else {
    // analyze() names the culprit here once every rule has run (the findings must agree).
    f.suggestions.push_back({"Fix what overflows (see the overflow-origin and forward-nonfinite findings); the scale "
                             "recovers once nothing overflows.", "", ""});
  }
  out.push_back(f);
}

namespace {

// A skip-rate finding for `rate` of the steps: "N% of optimizer steps were skipped" and
// `rest`, an error from half of them.
Finding skipped_share(double rate, const std::string& rest) {
  Finding f;
  f.rule = "skip-rate";
  f.severity = rate >= 0.5 ? Severity::kError : Severity::kWarning;
  f.score = 50.0 + rate * 10.0;
  f.title = pct(rate) + " of optimizer steps were skipped" + rest;
  return f;
}

// A growth probe is the scaler asking whether a doubled scale fits; at torch's default of one
// every 2000 steps its skip costs nothing. A short growth_interval asks so often that the
// probes themselves throw away a share of the steps, while every one of them is excused
// as probing.
void probing_too_often(const Run& run, std::int64_t probes, std::int64_t answers, std::int64_t first_probe,
                       std::int64_t considered, std::size_t end, std::vector<Finding>& out) {
  const double rate = double(probes + answers) / double(considered);
  const std::string interval = run.meta_or("scaler_growth_interval", "");
  // Where it settles between probes: the median scale of the steps that were taken.
  std::vector<double> taken;
  for (std::size_t i = end; i < run.steps.size(); ++i)
    if (!run.steps[i].row.skipped) taken.push_back(run.steps[i].row.scale_before);
  Finding f = skipped_share(rate, " by the scaler's own growth probes: it tries a higher scale too often");
  f.evidence = std::to_string(probes) + " of " + plural(considered, "step") +
               " were skipped right after the scale grew, each try at a scale the gradients do not fit";
  if (answers > 0)
    f.evidence += ", and " + std::to_string(answers) + " more as it came back down, at scales it had held for only a "
                  "step or few before the try";
  if (!interval.empty()) f.evidence += "; growth_interval=" + interval;
  f.steps.push_back(first_probe);
  const double settled = taken.empty() ? run.steps.back().row.scale_after : median_of(taken);
  f.suggestions.push_back(suggest::scaler_settings(
      run, settled, 2000,
      "Let the scaler try to grow less often (torch's default growth_interval is 2000): each try that overflows is "
      "a skipped step. Start it where it settled, " + fmt(settled) + "."));
  out.push_back(f);
}

}  // namespace

void skip_rate(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  if (!run.has_scaler()) return;
  const std::size_t end = calibration_end(run);
  const std::int64_t calibration = calibration_skips(run);
  std::int64_t skipped = 0, probes = 0, answers = 0, considered = 0, first = -1, first_probe = -1;
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    if (is_calibration(run, i, end)) continue;
    ++considered;
    if (!run.steps[i].row.skipped) continue;
    if (is_growth_probe(run, i)) {
      if (probes++ == 0) first_probe = run.steps[i].row.step;
      continue;
    }
    if (answers_growth_probe(run, i)) {
      ++answers;
      continue;
    }
    ++skipped;
    if (first < 0) first = run.steps[i].row.step;
  }
  if (considered == 0) {
    // Every step was skipped while backing off from init_scale.
    skipped = calibration;
    considered = std::int64_t(run.steps.size());
    first = run.steps.front().row.step;
  }
  // Probes are the scaler's planned cost: twice the unplanned skips' share (a growth_interval
  // of 4 or less) before they are a finding; torch's own interval is 2000.
  if (considered > 0 && double(probes + answers) > 2.0 * t.skip_rate * double(considered))
    probing_too_often(run, probes, answers, first_probe, considered, end, out);
  const double rate = harmful_skip_rate(run);
  if (rate <= t.skip_rate) return;
  Finding f = skipped_share(rate, "");
  f.evidence = std::to_string(skipped) + " of " + plural(considered, "step") + " skipped";
  if (calibration > 0 && considered < std::int64_t(run.steps.size()))
    f.evidence += " (not counting " + std::to_string(calibration) + " skipped at the start while the scale came down from " +
                  fmt(run.steps.front().row.scale_before) + ")";
  if (probes + answers > 0)
    f.evidence += " (not counting " + std::to_string(probes + answers) + " right after the scale grew" +
                  (answers > 0 ? " or coming back down from it" : "") + ": the scaler probing)";
  f.evidence += "; threshold " + fmt(t.skip_rate * 100.0) + "%";
  if (first >= 0) f.steps.push_back(first);
  if (calibration >= 4 && rate <= 0.5) {
    const double settled = end < run.steps.size() ? run.steps[end].row.scale_before : run.steps.back().row.scale_after;
    f.suggestions.push_back(suggest::scaler_settings(
        run, settled, std::atoll(run.meta_or("scaler_growth_interval", "2000").c_str()),
        "Start the scaler where it settled instead of halving down to it in " + std::to_string(calibration) + " skipped steps."));
  }
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
