// half-loss: a float16 loss handed to the scaler, which caps the loss scale by itself.
#include <algorithm>
#include <cstdio>
#include <string>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

// The backward of `loss * scale` starts with the scale as the loss's gradient, in the loss's
// dtype: 65536 is already Inf in fp16, and the loss's own ops (a sum, a pow, a mean's
// division) run their backward in fp16 before any layer's.
bool half_loss_skip(const StepSummary& s) { return s.row.skipped && s.row.scale_before > 65504.0; }

bool has_half_loss(const Run& run) { return run.first_event("half-loss") != nullptr; }

void half_loss(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("half-loss");
  if (!e || run.steps.empty()) return;
  std::vector<std::int64_t> capped;  // steps skipped because the scale itself was Inf in fp16
  for (const auto& s : run.steps)
    if (half_loss_skip(s)) capped.push_back(s.row.step);
  Finding f;
  f.rule = "half-loss";
  f.severity = Severity::kWarning;
  f.score = 35.0;
  f.steps = {std::max<std::int64_t>(e->step, run.steps.front().row.step)};
  for (std::size_t i = 0; i < capped.size() && f.steps.size() < 20; ++i)
    if (capped[i] != f.steps.front()) f.steps.push_back(capped[i]);
  f.title = "The loss is float16: its backward starts in fp16 at the loss scale, which keeps the loss scale below 65504";
  f.evidence = "scaler.scale() received a float16 loss (from step " + std::to_string(f.steps.front()) +
               "); the loss's gradient is the scale itself in fp16, Inf at any scale above 65504 (" +
               plural(std::int64_t(capped.size()), "step") +
               " skipped there), and the loss's own operations run their backward in fp16 before any layer's; the scale "
               "went " + fmt(run.steps.front().row.scale_before) + " -> " + fmt(run.steps.back().row.scale_after);
  f.suggestions.push_back(suggest::fp32_loss(""));
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
