#include "own_overflows.h"

#include <algorithm>
#include <map>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

std::vector<OwnOverflow> own_overflows_beside(const Run& run, const std::string& module,
                                              const std::vector<std::int64_t>& steps) {
  const std::string tail = ": finite, beside " + module;
  std::vector<OwnOverflow> beside;
  if (module.empty()) return beside;
  for (const auto& e : run.events) {
    const std::string& d = e.detail;
    if (e.kind != "companion-output-gradient" || d.size() <= tail.size() ||
        d.compare(d.size() - tail.size(), tail.size(), tail) != 0 || !std::binary_search(steps.begin(), steps.end(), e.step))
      continue;
    const std::string path = d.substr(0, d.size() - tail.size());
    if (suggest::within(path, module) || suggest::within(module, path) ||
        std::any_of(beside.begin(), beside.end(), [&](const OwnOverflow& o) { return o.path == path; }))
      continue;
    const StepSummary* step = run.step_summary(e.step);
    if (!step) continue;
    for (const std::int64_t id : step->nonfinite_layers)
      if (suggest::within(run.layers[std::size_t(id)].info.module_path, path)) {
        beside.push_back({path, e.step, run.layers[std::size_t(id)].info.name});
        break;
      }
  }
  return beside;
}

namespace {

// The largest unscaled gradient of the layers in `path`, in the steps where they stayed finite.
double largest_true_gradient_in(const Run& run, const std::string& path, const std::map<std::int64_t, double>& scale_of) {
  double largest = 0.0;
  for (const LayerSummary& layer : run.layers)
    if (suggest::within(layer.info.module_path, path))
      largest = std::max(largest, largest_true_gradient(layer, scale_of).first);
  return largest;
}

}  // namespace

bool pin_with_own_overflows(const Run& run, const std::string& module, const std::string& place,
                            const std::vector<std::int64_t>& steps, bool retitle, Finding& f) {
  const std::vector<OwnOverflow> beside = own_overflows_beside(run, module, steps);
  if (beside.empty()) return false;
  const std::map<std::int64_t, double> scale_of = scales_before(run);
  std::string names, sizes;  // "q", "q and v", "q, v and o"; "q's up to 0.36, v's up to 0.75"
  std::vector<std::string> more;
  for (const OwnOverflow& o : beside) {
    const std::string joint = names.empty() ? "" : &o == &beside.back() ? " and " : ", ";
    names += joint + o.path;
    if (const double largest = largest_true_gradient_in(run, o.path, scale_of); largest > 0.0)
      sizes += (sizes.empty() ? "" : ", ") + o.path + "'s up to " + fmt(largest);
    f.evidence += "; at step " + std::to_string(o.step) + " " + o.layer + " went NaN/Inf too, after " + module +
                  "'s, with the gradient reaching " + o.path + "'s output finite: " + o.path + "'s own backward "
                  "overflowed as well, not " + module + "'s NaN/Inf passed on";
    if (&o != &beside.front()) more.push_back(o.path);
  }
  // How far the scale could rise with the module alone pinned: to where theirs fit.
  const double own = largest_true_gradient_in(run, module, scale_of);
  if (!sizes.empty() && own > 0.0) sizes = " (" + sizes + " unscaled, against " + module + "'s " + fmt(own) + ")";
  else sizes.clear();
  if (retitle)
    f.title = place + " overflows first in backward, and " + names + " in " + (beside.size() == 1 ? "its" : "their") +
              " own backward in the same steps";
  Suggestion pin = suggest::pin_fp32_both(run, module, beside.front().path, "", more);
  pin.summary = "Run " + module + (more.empty() ? " and " : ", ") + names + " in FP32 together: pinned alone, " +
                module + " would leave " + names + "'s overflow, and the scale would still have to come down to "
                "where " + (beside.size() == 1 ? "its" : "their") + " gradients fit" + sizes + ".";
  f.suggestions.push_back(pin);
  return true;
}

}  // namespace ampdiag::analyzer::rules
