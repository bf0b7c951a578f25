// The information findings of a scale's calibration, made one: as the scale comes down from
// its initial value, the first gradient to overflow can move from module to module (a
// ConvMixer's nine halvings, each first in another block), and nine findings alike, each
// "the loss scale copes", say less than one that lists them.
#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include "rules.h"

namespace ampdiag::analyzer::rules {

namespace {

// One kind of such findings: `marker` follows the module's place in each title, and every
// one grouped shares what comes after it (the module whose overflows took the scale below
// the floor, for the second kind).
struct Kind {
  std::string marker;
  std::string evidence;  // what the evidence holds of each
  // The grouped title: how many modules, and what comes after the marker.
  std::string (*title)(std::size_t count, const std::string& tail);
  // What the grouped evidence says after the list of modules.
  std::string after_list;
};

void group_kind(std::vector<Finding>& found, const Kind& kind) {
  constexpr std::size_t kAlike = 3, kNamed = 8;
  // Findings of the kind, by the tail of their title: those alike are grouped.
  std::vector<Finding> rest;
  std::vector<std::pair<std::string, std::vector<Finding>>> groups;
  std::vector<std::size_t> places;
  for (auto& f : found) {
    const std::size_t at = f.title.find(kind.marker);
    if (f.rule != "overflow-origin" || f.severity != Severity::kInfo || at == std::string::npos || f.steps.empty() ||
        f.evidence.find(kind.evidence) == std::string::npos) {
      rest.push_back(std::move(f));
      continue;
    }
    const std::string tail = f.title.substr(at + kind.marker.size());
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == tail; });
    if (g == groups.end()) {
      groups.emplace_back(tail, std::vector<Finding>{});
      places.push_back(rest.size());
      g = std::prev(groups.end());
    }
    g->second.push_back(std::move(f));
  }
  // Back into place, the groups from the last so that the earlier places hold.
  for (std::size_t k = groups.size(); k-- > 0;) {
    auto& [tail, alike] = groups[k];
    const auto at = rest.begin() + std::ptrdiff_t(places[k]);
    if (alike.size() < kAlike) {
      rest.insert(at, std::make_move_iterator(alike.begin()), std::make_move_iterator(alike.end()));
      continue;
    }
    std::stable_sort(alike.begin(), alike.end(),
                     [](const Finding& a, const Finding& b) { return a.steps.front() < b.steps.front(); });
    Finding g = alike.front();
    g.title = kind.title(alike.size(), tail);
    std::string listed;
    std::vector<std::int64_t> steps;
    for (std::size_t i = 0; i < alike.size(); ++i) {
      const Finding& f = alike[i];
      steps.insert(steps.end(), f.steps.begin(), f.steps.end());
      if (i >= kNamed) continue;
      const std::string who = f.title.substr(0, f.title.find(kind.marker));
      listed += (i ? ", " : "") + who + " (step" + (f.steps.size() > 1 ? "s " : " ") + step_list(f.steps) + ")";
    }
    if (alike.size() > kNamed) listed += " and " + plural(std::int64_t(alike.size() - kNamed), "more module");
    std::sort(steps.begin(), steps.end());
    g.steps.assign(steps.begin(), steps.begin() + std::ptrdiff_t(std::min<std::size_t>(steps.size(), 20)));
    g.evidence = "the first gradient to hold NaN/Inf was in " + listed + kind.after_list;
    rest.insert(at, std::move(g));
  }
  found = std::move(rest);
}

}  // namespace

void group_calibration_overflows(std::vector<Finding>& found) {
  group_kind(found, {" is where the occasional overflow starts; the loss scale copes with it",
                     "these skips only calibrate it or answer its growth probes",
                     [](std::size_t count, const std::string&) {
                       return std::to_string(count) + " modules went NaN/Inf first, each in skips that only "
                              "calibrated the loss scale or answered its growth probes; the loss scale copes with it";
                     },
                     ": which overflows first depends on the scale tried, as the scaler calibrates it or probes a "
                     "higher one; the scale stays above the floor"});
  // Those first only above the floor while one module's overflows took the scale below it (an
  // Inception v3 from scratch: seven branches first as the scale came down from 65536, then
  // its stem convolution's gradients held it at 32).
  group_kind(found, {" went NaN/Inf first only at loss scales above the floor; ",
                     "where they only calibrated the scale or answered its growth probes",
                     [](std::size_t count, const std::string& tail) {
                       return std::to_string(count) + " modules went NaN/Inf first only at loss scales above the "
                              "floor; " + tail;
                     },
                     ": each in skips that only calibrated the scale or answered its growth probes, as the scaler "
                     "came down to where the overflows that took it below the floor began"});
}

}  // namespace ampdiag::analyzer::rules
