// The information findings of a scale's calibration, made one: as the scale comes down from
// its initial value, the first gradient to overflow can move from module to module (a
// ConvMixer's nine halvings, each first in another block), and nine findings alike, each
// "the loss scale copes", say less than one that lists them.
#include <algorithm>
#include <string>
#include <vector>

#include "rules.h"

namespace ampdiag::analyzer::rules {

void group_calibration_overflows(std::vector<Finding>& found) {
  const std::string copes = " is where the occasional overflow starts; the loss scale copes with it";
  const std::string calibrates = "these skips only calibrate it or answer its growth probes";
  std::vector<Finding> alike, rest;
  std::size_t place = 0;
  for (auto& f : found) {
    if (f.rule == "overflow-origin" && f.severity == Severity::kInfo && ends_with(f.title, copes) &&
        f.evidence.find(calibrates) != std::string::npos && !f.steps.empty()) {
      if (alike.empty()) place = rest.size();
      alike.push_back(std::move(f));
    } else {
      rest.push_back(std::move(f));
    }
  }
  constexpr std::size_t kAlike = 3, kNamed = 8;
  if (alike.size() < kAlike) {
    for (auto& f : alike) rest.push_back(std::move(f));
    found = std::move(rest);
    return;
  }
  std::stable_sort(alike.begin(), alike.end(),
                   [](const Finding& a, const Finding& b) { return a.steps.front() < b.steps.front(); });
  Finding g = alike.front();
  g.title = std::to_string(alike.size()) + " modules went NaN/Inf first, each in skips that only calibrated the loss "
            "scale or answered its growth probes; the loss scale copes with it";
  std::string listed;
  std::vector<std::int64_t> steps;
  for (std::size_t i = 0; i < alike.size(); ++i) {
    const Finding& f = alike[i];
    steps.insert(steps.end(), f.steps.begin(), f.steps.end());
    if (i >= kNamed) continue;
    const std::string who = f.title.substr(0, f.title.size() - copes.size());
    listed += (i ? ", " : "") + who + " (step" + (f.steps.size() > 1 ? "s " : " ") + step_list(f.steps) + ")";
  }
  if (alike.size() > kNamed) listed += " and " + plural(std::int64_t(alike.size() - kNamed), "more module");
  std::sort(steps.begin(), steps.end());
  g.steps.assign(steps.begin(), steps.begin() + std::ptrdiff_t(std::min<std::size_t>(steps.size(), 20)));
  g.evidence = "the first gradient to hold NaN/Inf was in " + listed + ": which overflows first depends on the "
               "scale tried, as the scaler calibrates it or probes a higher one; the scale stays above the floor";
  rest.insert(rest.begin() + std::ptrdiff_t(place), std::move(g));
  found = std::move(rest);
}

}  // namespace ampdiag::analyzer::rules
