// fused-sgd-momentum: torch's SGD(momentum=m, fused=True) makes its momentum buffers with
// torch.empty_like in its first step and fills them in that step's kernel, which a step the
// scaler skips does not run. Where that first step was skipped (the scale's calibration at
// 65536 often skips it) the momentum starts from uninitialised memory, and the weights jump
// by orders of magnitude at the first applied step: the overflows that follow look like a
// learning rate far too high (weight-growth), and lowering it changes nothing. The Python
// agent looks at the buffers after that step (event fused-momentum-uninitialised); LibTorch's
// SGD has no fused kernel.
#include <cmath>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "rules.h"

namespace ampdiag::analyzer::rules {

namespace {

// The model's weights' L2 norm at each sampled step.
std::map<std::int64_t, double> model_norms(const Run& run) {
  std::map<std::int64_t, double> sumsq;
  for (const auto& w : run.weight_norms) sumsq[w.step] += w.l2 * w.l2;
  for (auto& [step, v] : sumsq) v = std::sqrt(v);
  return sumsq;
}

// The first step after `from` that the scaler applied, or -1.
std::int64_t first_applied_after(const Run& run, std::int64_t from) {
  for (const auto& s : run.steps)
    if (s.row.step > from && !s.row.skipped) return s.row.step;
  return -1;
}

// "lr=0.01, weight_decay=0, momentum=0.9" from event optimizer-settings
// ("SGD lr=0.01 weight_decay=0 momentum=0.9"), or "lr=..., momentum=..." without one.
std::string sgd_arguments(const rundb::EventRow* settings) {
  if (settings == nullptr || settings->detail.rfind("SGD ", 0) != 0) return "lr=..., momentum=...";
  std::istringstream words(settings->detail.substr(4));
  std::string word, args;
  while (words >> word && word.find('=') != std::string::npos) args += (args.empty() ? "" : ", ") + word;
  return args.empty() ? "lr=..., momentum=..." : args;
}

}  // namespace

bool fused_momentum_uninitialised(const Run& run) {
  return run.first_event("fused-momentum-uninitialised") != nullptr;
}

void fused_sgd_momentum(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("fused-momentum-uninitialised");
  if (!e) return;
  const std::int64_t applied = first_applied_after(run, e->step);
  Finding f;
  f.rule = "fused-sgd-momentum";
  f.severity = Severity::kError;
  f.score = 103.0;  // before what it causes: the weights' growth (102), the overflows (scale-collapse 100)
  f.steps = {e->step};
  f.title = "SGD(fused=True) started its momentum from uninitialised memory: the scaler skipped the step that "
            "created it";
  f.evidence = "at step " + std::to_string(e->step) + ", " + e->detail;
  // The weights the first applied step started from, and the first sample after it.
  const auto norms = model_norms(run);
  const auto after = applied >= 0 ? norms.upper_bound(applied) : norms.end();
  if (after != norms.begin() && after != norms.end()) {
    const auto before = std::prev(after);
    f.evidence += "; the model's weights (L2 norm) went from " + fmt(before->second) + " at step " +
                  std::to_string(before->first) + " to " + fmt(after->second) + " at step " +
                  std::to_string(after->first) + ", across the first step applied (" + std::to_string(applied) + ")";
  }
  f.evidence += ". The overflows that follow are that damage, not a learning rate too high";
  const std::string args = sgd_arguments(run.first_event("optimizer-settings"));
  f.suggestions.push_back(
      {"Build the SGD without fused=True (torch's default, foreach, fills its momentum only in a step it applies), "
       "and restart from a checkpoint from before step " +
           std::to_string(applied >= 0 ? applied : e->step) + ": the momentum and the weights it moved are damaged. "
           "Or keep fused=True and give the scaler an init_scale its first step does not overflow at.",
       "optimizer = torch.optim.SGD(model.parameters(), " + args + ")  # not fused=True",
       ""});
  // The update that wrote NaN/Inf from finite gradients is that momentum's doing, where it is
  // the first one applied after the skip.
  const std::string see = "SGD's momentum started from uninitialised memory (see fused-sgd-momentum): ";
  for (auto& g : out)
    if (g.rule == "nonfinite-update" && !g.steps.empty() && g.steps.front() == applied) {
      g.severity = Severity::kWarning;
      g.evidence += "; it is the first update after step " + std::to_string(e->step) +
                    "'s skip left fused SGD's new momentum buffers unfilled";
      g.suggestions = {{see + "fix that; this update's NaN/Inf goes with it.", "", "", ""}};
    }
  // From the first applied step: the skip that created the buffers is the scale calibrating.
  point_to_cause(out, applied >= 0 ? applied : e->step, see,
                 "it comes after step " + std::to_string(e->step) +
                     ", whose skip left fused SGD's new momentum buffers unfilled");
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
