// The fixes for gradients too large for the loss scale (overflow-origin, rules_overflow.cpp).
#include "loss_size_fixes.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "loss_code.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// The lowest finite recorded loss below 0, or 0 where none went below: a likelihood that
// leaves out its constant (PyTorch's Poisson NLL without Stirling's term, a Gaussian NLL)
// crosses 0 as it trains, so its size says nothing of its gradients (a Poisson loss on
// counts around 2000, around 111 while its gradients reached 7468).
double lowest_negative_loss(const Run& run) {
  double lowest = 0.0;
  for (const auto& s : run.steps)
    if (run.loss_known(s.row) && std::isfinite(s.row.loss)) lowest = std::min(lowest, s.row.loss);
  return lowest;
}

// The median of the finite recorded losses of the steps not in `steps` (ascending), NaN where none.
double median_loss_outside(const Run& run, const std::vector<std::int64_t>& steps) {
  std::vector<double> losses;
  for (const auto& s : run.steps)
    if (run.loss_known(s.row) && std::isfinite(s.row.loss) && !std::binary_search(steps.begin(), steps.end(), s.row.step))
      losses.push_back(s.row.loss);
  return median_of(losses);
}

// The module whose output, in some forward, reached 100 times the largest output of every
// module that finished before it there, and at least 256 (the largest such jump): where a
// model's values jump (a projection whose weights are 1e4 times too large, a frozen
// encoder's included), not where they grew a few times a block as a residual stream does.
// `module` null where none did; `absmax` and `before`: its output then, and that largest.
struct OutputJump {
  const ModuleSummary* module = nullptr;
  float absmax = 0.0f, before = 0.0f;
};

OutputJump output_jump(const Run& run) {
  OutputJump jump;
  for (const auto& m : run.modules) {
    if (m.info.path.empty() || !(m.jump_before > 0.0f) || m.jump_absmax < 256.0f || m.jump_absmax < 100.0f * m.jump_before)
      continue;
    if (!jump.module || m.jump_absmax / m.jump_before > jump.absmax / jump.before) jump = {&m, m.jump_absmax, m.jump_before};
  }
  return jump;
}

// The operation of the loss code read in `steps` (or, where none was, in any step whose
// output gradient overflowed) that enlarges by the most, at least kEnlarging, where the
// code's factors together enlarge at least `excess` times, so that without them the
// gradients would fit: a manual loss scale on top of the GradScaler's, a weight meant for
// another loss's scale. Not a distillation's T * T, which makes up for the 1 / T its
// softened logits took (net T), unless that is what the gradients exceed by. Null where
// none does; `code` holds what was read.
const loss_code::Op* largest_factor(const Run& run, const std::vector<std::int64_t>& steps, double excess,
                                    loss_code::Code& code) {
  code = loss_code::at_steps(run, steps);
  if (code.empty()) code = loss_code::at_steps(run, run.output_overflow_steps);
  if (code.empty()) code = loss_code::first(run);
  const loss_code::Op* largest = nullptr;
  double net = 1.0;
  for (const auto& op : code.ops) {
    net *= op.gain();
    if (op.gain() >= loss_code::kEnlarging && (!largest || op.gain() > largest->gain())) largest = &op;
  }
  return largest && net >= excess ? largest : nullptr;
}

// Whether the loss code computes a loss over class indices (nll_loss, cross_entropy's),
// whose targets no normalisation shrinks.
bool classifies(const loss_code::Code& code) {
  return std::any_of(code.ops.begin(), code.ops.end(),
                     [](const loss_code::Op& op) { return op.name.rfind("NllLoss", 0) == 0; });
}

// "Take out the loss code's multiplication by 1e+06 (Mul) ...": what it multiplies, every
// gradient is that many times larger for; `loss` the loss it makes (NaN: unknown).
Suggestion take_out_factor(const loss_code::Code& code, const loss_code::Op& op, double loss) {
  const bool div = op.name == "Div";
  const bool last = &op == &code.ops.back();  // on the loss itself, after its reduction
  std::string summary = "Take out the loss code's " + std::string(div ? "division" : "multiplication") + " by " +
                        fmt(op.constant) + " (" + op.name + ", " + op.dtype + "), which makes every gradient " +
                        fmt(op.gain()) + " times larger";
  if (last && std::isfinite(loss))
    summary += ": the loss is around " + fmt(loss) + " with it, about " + fmt(loss / op.gain()) + " without";
  summary += ". The GradScaler already multiplies the loss for fp16's sake and divides the gradients back before "
             "the optimizer sees them; a factor of the code's own on top of it only brings them nearer 65504. Where "
             "it weighs this loss against another, weigh the other down instead. Adam's steps stay the same without "
             "it; SGD's shrink by as much, which its learning rate makes up.";
  return {summary,
          "loss = loss_fn(model(x), y)  # without the factor of " + fmt(op.gain()) +
              ": scaler.scale(loss) does fp16's scaling\nscaler.scale(loss).backward()",
          "auto loss = loss_fn(model->forward(x), y);  // without the factor of " + fmt(op.gain()) +
              ": scaler.scale(loss) does fp16's scaling\nscaler.scale(loss).backward();",
          ""};
}

}  // namespace

bool loss_explains(double loss, double gradient) {
  return std::isfinite(loss) && 16.0 * std::max(std::fabs(loss), std::sqrt(std::fabs(loss))) >= gradient;
}

bool residuals_explain(double loss, double gradient) {
  return std::isfinite(loss) && 16.0 * std::sqrt(std::fabs(loss)) >= gradient;
}

void shrink_the_loss(const Run& run, const std::vector<double>& losses, const std::vector<std::int64_t>& steps,
                     double gradient, double excess, Finding& f) {
  // The loss of the steps it overflowed in: the one that made its gradients this large,
  // not the smaller one the run trains down to once they fit (a loss of ~1000 while an
  // oversized layer's outputs overflowed, 0.08 later).
  std::vector<double> overflowed = losses;
  const double loss = overflowed.empty() ? median_loss_outside(run, {}) : median_of(overflowed);
  // Where it is 100 times the loss of the other steps, what those steps do differently
  // makes it: the targets are the same every step, and the sampled outputs may not be
  // of those steps at all (an expert the router picks only then).
  const double calm = median_loss_outside(run, steps);
  const bool intermittent = !overflowed.empty() && std::isfinite(calm) && calm > 0.0 && loss >= 100.0 * calm;
  const double negative = lowest_negative_loss(run);
  const bool crosses_zero = negative < 0.0;
  // Outputs near the loss's root are the model's: large targets learnt, or a model that
  // makes large values (a head initialised 1e4 times too large), which no target
  // normalisation fixes. Small ones leave the targets, or a sum.
  const ModuleSummary* last = run.last_module();
  const OutputJump jump = output_jump(run);
  const std::string jumped = jump.module != nullptr && jump.module != last
                                 ? jump.module->info.path + "'s reach " + fmt(jump.absmax) + ", " +
                                       fmt(std::floor(double(jump.absmax) / double(jump.before))) +
                                       " times the largest output of any module before it in forward order (its "
                                       "weights, its input's scale)"
                                 : "";
  // A loss that goes below 0 has no size to set the outputs against.
  const auto of_the_loss_size = [&](double absmax) {
    return std::isfinite(loss) && loss > 0 && !crosses_zero && absmax >= std::max(8.0, std::sqrt(loss) / 10.0);
  };
  const bool large_outputs = last && of_the_loss_size(double(last->max_absmax));
  // Outputs that large made inside the model, before a last module whose own are small (DETR's
  // class head 3e4 times too large, its logits up to 11096 under a loss of 5360, before a box
  // head of sigmoid-bound outputs): that module makes the loss, not the targets.
  const bool large_jump = !large_outputs && !jumped.empty() && of_the_loss_size(double(jump.absmax));
  std::string summary = "Shrink the loss where it is made";
  if (intermittent) {
    summary += " (it is around " + fmt(loss) + " in the steps where its gradients overflowed, against " + fmt(calm) +
               " in the others, and its gradients are as large): what those steps do differently makes it so "
               "large (a batch with outliers, a branch or an expert only they take)" +
               (jumped.empty() ? std::string() : "; where the outputs jump: " + jumped) +
               "; or average over the batch instead of summing, or divide the loss by a constant.";
    f.suggestions.push_back({summary, "", "", ""});
  } else if (std::isfinite(loss) && !crosses_zero && !loss_explains(loss, gradient)) {
    // MobileOne's 1x1 depthwise scale branch before a BatchNorm, whose weight's gradient is
    // zero in exact arithmetic, left fp16 rounding of 790 under a cross-entropy around 2.9.
    f.evidence += "; the loss is around " + fmt(loss) + ", whose gradients are of the order of it: "
                  "the model's own operations make them this large (large weights or a gain inside it, a "
                  "normalisation dividing by a small spread), and shrinking the loss would only do what a lower "
                  "scale does";
  } else {
    // Outputs this large from weights that started far too large: re-initialising them
    // comes first (an LM head 3e4 times too large, over token ids no target normalisation
    // helps). Small outputs leave the loss to the targets or a sum, whatever the gains.
    loss_code::Code code;
    if (const loss_code::Op* factor = largest_factor(run, steps, excess, code))
      f.suggestions.push_back(take_out_factor(code, *factor, loss));
    const ModuleSummary* maker = !jumped.empty() ? jump.module : last;
    if ((large_outputs || large_jump) && maker)
      if (auto fix = reinitialise_for_outputs(run, maker->info.path,
                                              maker == last ? last->max_absmax : jump.absmax, loss))
        f.suggestions.push_back(*fix);
    // No module probed (a LibTorch model no agent.probe() or forward() watched): either may
    // hold (a classifier's head 17000 times too large makes a cross-entropy of 10760).
    const std::string targets =
        large_outputs && classifies(code)
            ? "; the model's outputs are large (" + last->info.path + "'s, the last module's, reach " +
                  fmt(last->max_absmax) + ") and its targets are class indices, which no normalisation shrinks: find "
                  "what makes the outputs so large" +
                  (jumped.empty() ? std::string(" (its weights, its input's scale)") : ": " + jumped) + "; or average"
        : large_outputs ? "; the model's outputs are large too (" + last->info.path + "'s, the last module's, reach " +
                            fmt(last->max_absmax) + "): where the targets are that large, normalise them to unit "
                            "spread, and where they are not, find what makes the outputs so large" +
                            (jumped.empty() ? std::string(" (its weights, its input's scale)") : ": " + jumped) +
                            "; or average"
        : large_jump ? "; inside the model the outputs are large: " + jumped + "; find what makes them so large, or "
                       "average"
        : run.modules.empty() ? "; no module output was probed to say whether the model's outputs are that large: "
                                "where the targets are, normalise them to unit spread, and where they are not, find "
                                "what makes the outputs so large (its weights, its input's scale); or average"
        : classifies(code)    ? ": its targets are class indices, which no normalisation shrinks; average"
        // A likelihood's targets may have to stay non-negative (a Poisson's counts): scaled, not centred.
        : crosses_zero ? ": scale the regression targets down to units of their typical size (counts stay "
                           "non-negative, as a Poisson likelihood needs), average"
                         : ": normalise the regression targets to unit spread, average";
    const std::string size =
        crosses_zero ? " (it goes below 0, down to " + fmt(negative) + ": it leaves out a constant, so its size does "
                         "not show how large its gradients are, " +
                         (gradient >= run.fp_max ? "beyond " + fmt(run.fp_max) : "up to " + fmt(gradient)) +
                         " unscaled)"
        : std::isfinite(loss) ? " (it is around " + fmt(loss) + ", and its gradients are as large)"
                              : std::string();
    summary += size + targets + " over the batch instead of summing, or divide the loss by a constant.";
    if (!run.modules.empty() && (classifies(code) || large_jump))
      f.suggestions.push_back({summary, "", "", ""});
    else if (crosses_zero && !run.modules.empty())
      f.suggestions.push_back(
          {summary,
           "y = y / y_scale  # targets in units of their typical size (predictions: * y_scale)\n"
           "loss = loss_fn(model(x).float(), y)",
           "auto y_n = y / y_scale;  // predictions: * y_scale\n"
           "auto loss = loss_fn(model->forward(x).to(torch::kFloat), y_n);",
           ""});
    else
      f.suggestions.push_back(
          {summary,
           "y = (y - y_mean) / y_std  # targets in units of their spread (predictions: * y_std + y_mean)\n"
           "loss = loss_fn(model(x).float(), y)",
           "auto y_n = (y - y_mean) / y_std;  // predictions: * y_std + y_mean\n"
           "auto loss = loss_fn(model->forward(x).to(torch::kFloat), y_n);",
           ""});
  }
}

}  // namespace ampdiag::analyzer::rules
