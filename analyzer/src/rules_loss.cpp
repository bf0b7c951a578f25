// half-loss: a float16 loss handed to the scaler, which caps the loss scale by itself.
// loss-backward: NaN/Inf made by the loss code's backward, before any module.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/causes.h"
#include "loss_code.h"
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

namespace {

// The lowest loss scale among `steps` at which the gradient reaching the output held Inf only.
double lowest_overflow(const Run& run, const std::vector<std::int64_t>& steps) {
  double lowest = INFINITY;
  for (const auto& s : run.steps)
    if (std::binary_search(steps.begin(), steps.end(), s.row.step) && run.output_overflow_in_loss(s.row.step))
      lowest = std::min(lowest, s.row.scale_before);
  return lowest;
}

}  // namespace

void loss_backward(const Run& run, std::vector<Finding>& out) {
  std::int64_t n = 0, hurt = 0;
  double lowest = INFINITY;
  Finding f;
  std::vector<std::int64_t> steps;
  const bool half_loss = has_half_loss(run);
  for (const auto& s : run.steps) {
    if (step_cause(run, s).forward != ForwardSource::kLossBackward) continue;
    // A float16 loss's gradient is the scale itself, Inf in fp16 above 65504: half-loss says so.
    if (half_loss && half_loss_skip(s)) continue;
    if (n++ < 20) f.steps.push_back(s.row.step);
    steps.push_back(s.row.step);
    hurt += s.row.skipped || s.gradients_nonfinite();
    lowest = std::min(lowest, s.row.scale_before);
  }
  if (n == 0) return;
  std::string detail;
  for (const auto& e : run.events)
    if ((e.kind == "output-gradient-nonfinite" || e.kind == "output-gradient-overflow") && e.step == f.steps.front())
      detail = e.detail;
  std::int64_t overflows = 0;  // of the steps, those whose float16 gradient held Inf only
  for (const std::int64_t step : steps) overflows += run.output_overflow_in_loss(step) ? 1 : 0;
  const loss_code::Code code = loss_code::at_steps(run, steps);
  f.rule = "loss-backward";
  f.severity = hurt ? Severity::kError : Severity::kInfo;
  f.score = hurt ? 91.0 : 5.0;
  f.title = "The loss's backward makes NaN/Inf before any module: the gradient reaching the model's output holds them";
  f.evidence = "in " + plural(n, "step") + ", from step " + std::to_string(f.steps.front()) +
               ", every probed output and the loss were finite, and the gradient reaching the model's output already "
               "held NaN/Inf" + (detail.empty() ? "" : " (" + detail + ")") + "; " + std::to_string(hurt) +
               " of them skipped or with NaN/Inf gradients";
  if (run.has_scaler()) f.evidence += "; at loss scales down to " + fmt(lowest) + ", so not the scale";
  if (!code.empty())
    f.evidence += "; the operations from the model's output to the loss (step " + std::to_string(code.step) +
                  "): " + code.describe();
  // Its fp16 backward made values above 65504 from a finite gradient (log's 1/p of a p near
  // 0): in FP32 they stay finite, and the gradient into the model with them.
  const bool fp16_backward = overflows > 0 && code.any_half();
  if (fp16_backward)
    f.suggestions.push_back(suggest::fp32_loss(
        code.float16_compute() + " ran in float16, and in " + plural(overflows, "step") +
        " the float16 gradient they sent into the model's output held Inf at loss scales down to " +
        fmt(lowest_overflow(run, steps)) + ":"));
  std::vector<loss_code::Fix> found = loss_code::fixes(code, loss_code::Phase::kBackward);
  // Traced: the operation whose backward made them leads, whatever comes before it in forward
  // order (a pairwise distance's sqrt of 0 after F.normalize's division, which divides by
  // norms far from 0); the others' fixes cannot be the origin.
  const loss_code::Code traced = loss_code::origin(run);
  std::string traced_op;
  if (!traced.empty()) {
    const loss_code::Op& made = traced.ops.back();
    traced_op = made.name + " (" + made.dtype + ")";
    f.evidence += "; at step " + std::to_string(traced.step) + " " + traced_op + " was the first of it whose backward "
                  "sent NaN/Inf back from finite gradients";
    if (traced.ops.size() > 1) {
      loss_code::Code before = traced;
      before.ops.pop_back();
      f.evidence += ", after " + before.describe();
    }
    loss_code::Code last;
    last.ops = {made};
    found = loss_code::fixes(last, loss_code::Phase::kBackward);
  }
  if (!found.empty()) f.suggestions.push_back(found.front().suggestion);
  // That fix clamps in float32, "in the loss computed in FP32": its own fix follows.
  if (!found.empty() && !fp16_backward && (found.front().dtype == "float16" || found.front().dtype == "bfloat16"))
    f.suggestions.push_back(suggest::fp32_loss("To clamp in float32:"));
  const std::string look = loss_code::look_also(
      found,
      (found.empty() && !traced_op.empty() ? traced_op + "'s backward made them from finite gradients. " : "") +
      std::string("Look at the code between the model's output and the loss, where backward starts: a function whose "
                  "gradient is infinite where it is evaluated (sqrt of 0, as a distance from a point to itself; log of "
                  "0; a division by 0; acos or asin at 1) makes NaN from finite values in any precision. Keep its "
                  "argument off that point") +
          // (A pin of the last module makes an fp16 loss code's inputs float32: it can help there.)
          (fp16_backward ? "." : "; pinning the model's modules to FP32 cannot help."));
  if (found.empty())
    f.suggestions.push_back({look, "d = (diff.pow(2).sum(-1) + 1e-12).sqrt()  # sqrt(0)'s gradient is infinite",
                             "auto d = (diff.pow(2).sum(-1) + 1e-12).sqrt();  // sqrt(0)'s gradient is infinite", ""});
  else
    f.suggestions.push_back({look, "", "", ""});
  if (has_half_loss(run) && !fp16_backward)
    f.suggestions.push_back(suggest::fp32_loss("The loss is float16, so its backward runs in fp16:"));
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
