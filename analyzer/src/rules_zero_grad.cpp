// gradients-not-zeroed: the gradients were never zeroed between optimizer steps (event
// from the Python agent, which looks at one parameter's .grad as its step's first gradient
// arrives). Each step adds its gradients to every earlier one: they grow until they leave
// fp16's range, and the layer that overflows first is where that shows, not why.
// gradients-cleared: the other misplaced zero_grad(), between backward and the optimizer
// step (set_to_none=False: with None torch's scaler raises). The statistics are taken at
// the step, so every gradient is exactly zero there, and nothing trains. zero-gradients:
// the same zeros where the Python agent saw one arrive zero from backward: the loss's.
// accumulated-gradients-cleared: zero_grad() inside the loop over micro-batches (event from
// the Python agent, at each step where a micro-batch's gradient was gone before the next
// one's backward). Nothing overflows; each step applies only its last micro-batches.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "rules.h"

namespace ampdiag::analyzer::rules {

namespace {

// The run's own loop (with or without its scaler) with zero_grad() where it belongs,
// `where` saying so in a comment on that line.
Suggestion zeroing_loop(const Run& run, const std::string& summary, const std::string& where) {
  const std::string python = "optimizer.zero_grad()  # " + where + "\n";
  const std::string cpp = "optimizer.zero_grad();  // " + where + "\n";
  if (run.has_scaler())
    return {summary,
            python + "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()",
            cpp + "scaler.scale(loss).backward();  // ampdiag::GradScaler\nscaler.step(optimizer);\nscaler.update();"};
  return {summary, python + "loss.backward()\noptimizer.step()", cpp + "loss.backward();\noptimizer.step();"};
}

// "at step 10 classifier.3's output, the model's last, was all zeros (80 of 80 values), while
// classifier.1's, which finished just before it, was not" where the last module's output was
// all zeros at a step from `from` on; empty where it was not (or no module was probed).
std::string zero_output(const Run& run, std::int64_t from) {
  const ModuleSummary* last = run.last_module(true);
  if (!last || last->zero_step < from) return "";
  // Back to the first of the modules before it whose outputs were all zeros too.
  const ModuleSummary* zero = last;
  for (std::size_t hops = 0; hops < run.modules.size() && zero->before_last >= 0; ++hops) {
    const ModuleSummary& before = run.modules[std::size_t(zero->before_last)];
    if (before.zero_step < from) break;
    zero = &before;
  }
  std::string text = "at step " + std::to_string(zero->zero_step) + " " + zero->info.path + "'s output" +
                     (zero == last ? ", the model's last," : "") + " was all zeros (" + std::to_string(zero->zero_numel) +
                     " of " + std::to_string(zero->zero_numel) + " values)";
  if (zero != last) text += ", and so were those after it up to the model's last, " + last->info.path;
  if (zero->before_last >= 0)
    text += ", while " + run.modules[std::size_t(zero->before_last)].info.path +
            "'s, which finished just before it, was not: what ran between them or in " + zero->info.path +
            " zeroed every value";
  return text;
}

}  // namespace

void gradients_not_zeroed(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("gradients-not-zeroed");
  if (!e) return;
  const std::int64_t from = e->step >= 0 ? e->step : run.steps.front().row.step;
  Finding f;
  f.rule = "gradients-not-zeroed";
  f.severity = Severity::kError;
  f.score = 103.0;  // before what it causes: a loss that diverges (102), the overflows (scale-collapse 100)
  f.steps = {from};
  f.title = "The gradients were not zeroed between optimizer steps: each step's gradients were added to all the "
            "earlier ones";
  f.evidence = "from step " + std::to_string(from) + ", " + e->detail;
  f.evidence += ". The overflows that follow are where the sum left fp16's range, not why";
  const std::string summary = "Zero the gradients once per optimizer step, before its backward (with gradient "
                              "accumulation: after the optimizer step, every N micro-batches).";
  f.suggestions.push_back(zeroing_loop(run, summary, "once per optimizer step"));
  // What the growing sum makes is its doing: the fixes of the findings it explains wait for it.
  const std::string see = "The gradients were not zeroed between steps (see gradients-not-zeroed): ";
  for (auto& g : out) {
    // Mostly from then on: an overflow at the first step (the scale calibrating) is not one.
    const auto after = std::count_if(g.steps.begin(), g.steps.end(), [&](std::int64_t s) { return s >= from; });
    if (!g.steps.empty() && 2 * after <= std::int64_t(g.steps.size())) continue;
    if (g.rule == "overflow-origin" || g.rule == "loss-divergence" || g.rule == "forward-nonfinite" ||
        g.rule == "loss-backward") {
      if (g.severity == Severity::kError) g.severity = Severity::kWarning;
      g.evidence += "; it comes after the gradients stopped being zeroed at step " + std::to_string(from);
      g.suggestions = {{see + "zero them first; this holds only if it still happens then.", "", "", ""}};
    } else if (g.rule == "scale-collapse" || g.rule == "skip-rate") {
      g.suggestions = {{see + "zero them, and these overflows go with them.", "", "", ""}};
    }
  }
  out.push_back(f);
}

void gradients_cleared(const Run& run, const std::map<std::int64_t, StepGradients>& by_step,
                       std::vector<Finding>& out) {
  std::int64_t zero = 0, first = -1;
  for (const auto& [step, g] : by_step)
    if (g.all_zero && zero++ == 0) first = step;
  constexpr std::int64_t kMinSteps = 5;
  if (zero < kMinSteps || 2 * zero <= std::int64_t(by_step.size())) return;
  Finding f;
  f.rule = "gradients-cleared";
  f.severity = Severity::kError;
  f.score = 103.0;
  f.steps = {first};
  f.evidence = "in " + std::to_string(zero) + " of " + plural(std::int64_t(by_step.size()), "recorded step") +
               ", from step " + std::to_string(first) + ", each of the " + plural(std::int64_t(run.layers.size()), "gradient") +
               " was all zeros where " + (run.has_scaler() ? "scaler.step() unscaled them" : "the optimizer stepped");
  // The Python agent looks now and then at what a gradient arrived holding: zeros from
  // backward itself are the loss's, and no zero_grad() is to blame. So is a loss exactly 0
  // in every such step: a loop that clears the gradients still has a loss.
  const rundb::EventRow* arrived = nullptr;
  for (const auto& e : run.events)
    if (e.kind == "gradients-arrived-zero" && !arrived) {
      const auto g = by_step.find(e.step);
      if (g != by_step.end() && g->second.all_zero) arrived = &e;
    }
  std::int64_t zero_loss = 0, known = 0;
  for (const auto& s : run.steps) {
    const auto g = by_step.find(s.row.step);
    if (g == by_step.end() || !g->second.all_zero || !run.loss_known(s.row)) continue;
    ++known;
    zero_loss += s.row.loss == 0.0;
  }
  const bool loss_zero = known > 0 && zero_loss == known;
  if (arrived || loss_zero) {
    f.rule = "zero-gradients";
    f.title = "Every gradient was exactly zero when the optimizer stepped: backward made them zero, and nothing trains";
    const std::string zeros = loss_zero ? std::string() : zero_output(run, first);
    if (arrived)
      f.evidence += "; in step " + std::to_string(arrived->step) + ", " + arrived->detail +
                    ", before anything could clear it: " +
                    (zeros.empty() ? "the loss's gradient is zero" : "backward made it zero");
    if (loss_zero) f.evidence += std::string(arrived ? ", and" : ";") + " the loss was exactly 0 in every one of those steps";
    // Steps before the first all-zero one whose finite gradients were not all zero: the model
    // trained, then its loss reached 0 (a triplet loss once every triplet meets its margin).
    std::int64_t trained = 0;
    for (const auto& [step, g] : by_step) {
      if (step >= first) break;
      trained += g.finite && !g.all_zero;
    }
    if (loss_zero && trained >= kMinSteps) {
      f.severity = Severity::kInfo;
      f.score = 4.0;
      f.title = "The loss reached exactly 0 at step " + std::to_string(first) + ", after " +
                plural(trained, "step") + " that trained, and was 0 in " + plural(zero, "step") +
                ": those steps train nothing, and nothing overflowed or underflowed";
      f.suggestions.push_back({"No precision problem: backward made the gradients zero because the loss is exactly 0, "
                               "satisfied by every sample (a margin every triplet or pair meets, a hinge or a clamp at "
                               "0). If the model should go on learning, make the loss harder where it saturates (hard "
                               "negatives, a larger margin), or stop the training where it reaches 0.",
                               "", ""});
    } else if (!zeros.empty()) {
      f.title = "Every gradient was exactly zero when the optimizer stepped: the model's output was all zeros, so "
                "backward sent none back, and nothing trains";
      f.evidence += "; " + zeros;
      // Zeros from the first recorded step came before any optimizer step: the initialisation's
      // (DPT's depth head, a ReLU after a convolution of weights at std 0.02 and a bias of 0
      // over features that barely vary), which no learning rate explains.
      if (first <= run.steps.front().row.step)
        f.suggestions.push_back({"Find what zeroes the model's output: with every output 0 the loss's gradient stops "
                                 "there and no layer gets any. It was all zeros from the first step, before any "
                                 "optimizer step, so what the model started with made it (its initialisation, or a "
                                 "checkpoint it was loaded from): a ReLU at the end whose inputs all start below 0 (a "
                                 "dead ReLU) passes none back. Start the bias before it above 0, end in Softplus where "
                                 "the output must stay positive, or end the model with its last linear layer or "
                                 "convolution, no activation after it.",
                                 "", ""});
      else
        f.suggestions.push_back({"Find what zeroes the model's output: with every output 0 the loss's gradient stops "
                                 "there and no layer gets any. A ReLU at the end whose inputs have all gone negative "
                                 "(a dead ReLU, after an optimizer step too large: SqueezeNet's classifier ends in a "
                                 "ReLU before its pooling) passes none back. Lower the learning rate or warm it up, and "
                                 "end the model with its last linear layer or convolution, no activation after it.",
                                 "", ""});
    } else {
      f.suggestions.push_back({"Look at the loss, not at zero_grad(): its gradient is zero. It is exactly 0 or "
                               "saturated (a softmax temperature so small that every pair is already separated, a "
                               "margin every sample meets, a clamp or a threshold before it), or the model's output "
                               "reaches it only through a detached path (.detach(), .item(), a tensor rebuilt from "
                               "numpy).",
                               "", ""});
    }
    out.push_back(f);
    return;
  }
  f.title = "Every gradient was exactly zero when the optimizer stepped: they were cleared between backward and the "
            "step (or nothing reached them), and nothing trains";
  f.evidence += ": a zero_grad(set_to_none=False) between backward and the step";
  const std::string summary = "Zero the gradients before the backward (or after the optimizer step), never between them.";
  f.suggestions.push_back(zeroing_loop(run, summary, "before the backward"));
  out.push_back(f);
}

void accumulated_gradients_cleared(const Run& run, std::vector<Finding>& out) {
  // A step the scaler skipped applied nothing, so what was cleared in it says nothing about
  // accumulation (SAM, which leaves its weights in place when the first gradient overflowed
  // and then clears it, looks the same there).
  std::set<std::int64_t> skipped;
  for (const auto& s : run.steps)
    if (s.row.skipped) skipped.insert(s.row.step);
  std::vector<const rundb::EventRow*> events;
  std::size_t recorded = 0;
  for (const auto& e : run.events) {
    if (e.kind != "accumulated-gradients-cleared") continue;
    ++recorded;
    if (!skipped.count(e.step)) events.push_back(&e);
  }
  if (events.empty() || run.steps.empty()) return;
  // The agent writes the first kMaxEvents: past the last of those, nothing is known.
  constexpr std::size_t kMaxEvents = 64;
  const bool capped = recorded >= kMaxEvents;
  const std::int64_t from = events.front()->step;
  const std::int64_t to = capped ? events.back()->step : run.steps.back().row.step;
  const auto in_window = [&](const StepSummary& s) { return s.row.step >= from && s.row.step <= to; };
  const auto window = std::count_if(run.steps.begin(), run.steps.end(),
                                    [&](const StepSummary& s) { return in_window(s) && !s.row.skipped; });
  const auto skipped_in_window = std::count_if(run.steps.begin(), run.steps.end(),
                                               [&](const StepSummary& s) { return in_window(s) && s.row.skipped; });
  const auto n = std::int64_t(events.size());
  // A loop that clears inside its accumulation does it at every step; a batch dropped on
  // purpose (a guard) now and then is the loop's choice.
  const bool every_step = 2 * n >= window && n >= std::min<std::int64_t>(3, std::int64_t(run.steps.size()));
  Finding f;
  f.rule = "accumulated-gradients-cleared";
  f.steps = {from};
  f.evidence = "in " + std::to_string(n) + " of the " + plural(window, "step") + " from step " + std::to_string(from) +
               (skipped_in_window > 0 ? " (not counting the " + plural(skipped_in_window, "step") +
                                            " the scaler skipped, which applied nothing)"
                                      : "") +
               (capped ? " (the first " + std::to_string(kMaxEvents) + " recorded)" : "") + ", " +
               events.front()->detail;
  const std::string backward = run.has_scaler() ? "scaler.scale(loss).backward()" : "loss.backward()";
  const std::string step = run.has_scaler() ? "scaler.step(optimizer)\n        scaler.update()" : "optimizer.step()";
  const std::string cpp_step = run.has_scaler() ? "scaler.step(optimizer);\n    scaler.update();" : "optimizer.step();";
  Suggestion loop{"Zero the gradients once per optimizer step, after it, not for every micro-batch.",
                  "for i, (x, y) in enumerate(loader):\n    loss = loss_fn(model(x), y) / accumulation_steps\n    " +
                      backward + "\n    if (i + 1) % accumulation_steps == 0:\n        " + step +
                      "\n        optimizer.zero_grad()  # once per optimizer step",
                  "auto loss = loss_fn(model->forward(x), y) / accumulation_steps;\n" +
                      std::string(run.has_scaler() ? "scaler.scale(loss).backward();" : "loss.backward();") +
                      "\nif ((i + 1) % accumulation_steps == 0) {\n    " + cpp_step +
                      "\n    optimizer.zero_grad();  // once per optimizer step\n}"};
  if (every_step) {
    f.severity = Severity::kError;
    f.score = 103.0;
    f.title = "zero_grad() runs inside the gradient-accumulation loop: each optimizer step applied only its last "
              "micro-batch's gradients, and the others were computed and thrown away";
  } else {
    f.severity = Severity::kWarning;
    f.score = 40.0;
    f.title = "Some micro-batches' gradients were cleared before their optimizer step, in " +
              plural(n, "step") + ": if those batches were dropped on purpose nothing is wrong";
    loop.summary = "If no batch was meant to be dropped, zero the gradients only once per optimizer step, after it.";
  }
  f.suggestions.push_back(loop);
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
