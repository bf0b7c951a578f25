// weight-growth: the weights of the module that overflowed first grew many times over in the
// steps before it did. A learning rate far too high (AdamW at 0.3) moves every weight by
// about the learning rate each step, so the weights and the activations they make grow until
// fp16's range ends; the loss need not grow much on the way (loss-divergence then says
// nothing). The module that overflows is where it shows, not why, and pinning it to FP32
// only moves the overflow to the next one.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

constexpr double kGrew = 8.0;            // the module's weights' L2 norm, this many times its start
constexpr std::int64_t kWindow = 256;   // ...within this many steps up to the last NaN/Inf
constexpr double kLeast = 1e-3;          // ...from a root-mean-square value of at least this
// Or this many times in one optimizer step, from an RMS of at least kTrained, where the loss
// at least doubled with it and stayed finite: a step that moves the weights by about their
// own size (AdamW at 0.1 moves every weight by ~0.1, on weights of RMS 0.06 the norm grows
// 1.9x and a cross-entropy of 1.7 becomes 104; a sound rate moves them a thousandth). A step
// as large that lowers the loss is learning (a regression from a loss of 16 to 3.6 in one SGD
// step); one followed by NaN says more of its gradients than of the rate (the one step a
// similarity times 98716 let through); and weights started smaller (a head at std 1e-3) may
// be meant to take such steps.
constexpr double kJump = 1.5, kTrained = 3e-3, kLossRose = 2.0;
// A jump whose loss rose this many times harmed the run whatever the scaler made of it:
// growth by design (weights normalised in the forward) comes with a falling loss.
constexpr double kLossDiverged = 10.0;


bool one_of(const std::string& name, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (name == n) return true;
  return false;
}

// "lr=0.3" of an optimizer-settings detail; empty where it has none.
std::string lr_of(const std::string& detail) {
  const auto at = detail.find("lr=");
  return at == std::string::npos ? "" : detail.substr(at, detail.find(' ', at) - at);
}

// The optimizer's settings the weights grew under: its last optimizer-settings event at or
// before `step` (an agent records them again where a schedule moved the learning rate),
// else its first.
const rundb::EventRow* settings_at(const Run& run, std::int64_t step) {
  const rundb::EventRow* at = nullptr;
  for (const auto& e : run.events)
    if (e.kind == "optimizer-settings" && e.step <= step && (at == nullptr || e.step > at->step)) at = &e;
  return at != nullptr ? at : run.first_event("optimizer-settings");
}

// The optimizer line with a tenth of its learning rate, in Python and in C++, from event
// optimizer-settings ("AdamW lr=0.3 weight_decay=0.01"); placeholders where the run did not
// record it, or recorded lr=0 (a warm-up's first step). An optimizer from elsewhere (a
// package's Lion) keeps its own name. `scheduled`: a schedule moved the rate during the run.
std::pair<std::string, std::string> lower_lr(const rundb::EventRow* settings, bool scheduled) {
  const std::string any_cpp =
      "// the optimizer's learning rate well below the present one, or a warm-up:\n"
      "torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(/*lr=*/1e-4));";
  const std::string detail = settings != nullptr ? settings->detail : "";
  const auto space = detail.find(' '), at = detail.find("lr=");
  const double lr = at == std::string::npos ? 0.0 : std::atof(detail.c_str() + at + 3);
  if (space == std::string::npos || !(lr > 0.0))
    return {"optimizer = torch.optim.AdamW(model.parameters(), lr=...)  # well below the present lr, or warm it up",
            any_cpp};
  const std::string name = detail.substr(0, space);
  char tenth[64];
  std::snprintf(tenth, sizeof tenth, "%.3g", lr / 10);
  const std::string why = "a tenth of " + lr_of(detail) +
                          (scheduled ? ", the rate at step " + std::to_string(settings->step) +
                                           ": lower the schedule's peak as much"
                                     : "; or warm it up");
  const bool torch_python = one_of(name, {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam",
                                          "Adadelta", "ASGD", "Rprop", "SparseAdam", "LBFGS", "Adafactor", "Muon"});
  const bool torch_cpp = one_of(name, {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "LBFGS"});
  return {"optimizer = " + std::string(torch_python ? "torch.optim." : "") + name + "(model.parameters(), lr=" + tenth +
              ")  # " + why,
          torch_cpp ? "torch::optim::" + name + " optimizer(model->parameters(), torch::optim::" + name +
                          "Options(/*lr=*/" + tenth + "));  // " + why
                    : any_cpp};
}

std::string times(double r) {
  char b[32];
  std::snprintf(b, sizeof b, r < 10 ? "%.1fx" : r < 100 ? "%.0fx" : "%.3gx", r);
  return b;
}

// The root-mean-square value of a module's weights at a sample: their squared L2 norm there
// (`sumsq`) over how many values they hold (`values`, by sampled step).
double rms_at(double sumsq, const std::map<std::int64_t, std::int64_t>& values, std::int64_t step) {
  const auto held = values.find(step);
  return std::sqrt(sumsq / double(held == values.end() ? 1 : std::max<std::int64_t>(held->second, 1)));
}

// The steepest growth of a module's weights (`sumsq`, `values`: per sampled step, their
// squared L2 norms and values together) between samples from `from` to `to`, per optimizer
// step applied between them, where the loss at least doubled from one to the other.
struct Jump {
  double per_step = 0.0, total = 0.0;
  std::int64_t from = -1, to = -1, steps = 0;
  double loss_before = 0.0, loss_after = 0.0;
  std::int64_t applied = -1;  // the first optimizer step applied between the samples

  // "in one step (step 7)", "in 2 optimizer steps (steps 8 to 10)"
  std::string span() const {
    return steps == 1 ? " in one step (step " + std::to_string(applied) + ")"
                      : " in " + std::to_string(steps) + " optimizer steps (steps " + std::to_string(from) + " to " +
                            std::to_string(to) + ")";
  }
};

Jump steepest_jump(const std::map<std::int64_t, double>& sumsq, const std::map<std::int64_t, std::int64_t>& values,
                   const std::map<std::int64_t, double>& losses, const std::set<std::int64_t>& applied,
                   std::int64_t from, std::int64_t to) {
  Jump best;
  for (auto a = sumsq.lower_bound(from); a != sumsq.end() && a->first < to; ++a) {
    const auto b = std::next(a);
    if (b == sumsq.end() || b->first > to || !(a->second > 0.0)) continue;
    const auto n = std::int64_t(std::distance(applied.lower_bound(a->first), applied.lower_bound(b->first)));
    const double rms = rms_at(a->second, values, a->first);
    const auto before = losses.find(a->first), after = losses.find(b->first);
    if (n == 0 || n > 4 || !(rms >= kTrained) || before == losses.end() || after == losses.end() ||
        !(before->second > 0.0) || !std::isfinite(after->second) || !(after->second >= kLossRose * before->second))
      continue;
    const double total = std::sqrt(b->second / a->second), per_step = std::pow(total, 1.0 / double(n));
    if (per_step > best.per_step)
      best = {per_step, total, a->first, b->first, n, before->second, after->second, *applied.lower_bound(a->first)};
  }
  return best;
}

}  // namespace

void weight_growth(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  if (run.weight_norms.empty() || find_divergence(run).found || updates_held_scale(run) ||
      run.first_event("gradients-not-zeroed") != nullptr || fused_momentum_uninitialised(run))
    return;  // loss-divergence, optimizer-outside-scaler, gradients-not-zeroed or fused-sgd-momentum says why
  // The last step with NaN/Inf: the weights it ran with are the largest the overflows saw
  // (a skipped step leaves them as they were). Calibration skips count: an optimizer step
  // that grows the weights 8x may overflow from the next step on, while the scale descends.
  std::int64_t last = -1;
  for (const auto& s : run.steps)
    if (s.row.skipped || s.row.found_inf || run.loss_nonfinite(s.row) || s.first_nonfinite_module >= 0) last = s.row.step;
  if (last < 0) return;
  // Where it shows: the module the highest-scored overflow finding names, the next where
  // its own weights were not sampled (an LM's head, whose weight is the tied embedding's),
  // else the whole model.
  std::vector<const Finding*> overflows;
  for (const auto& f : out)
    if ((f.rule == "forward-nonfinite" || f.rule == "overflow-origin") && !f.module.empty()) overflows.push_back(&f);
  std::stable_sort(overflows.begin(), overflows.end(), [](const Finding* a, const Finding* b) { return a->score > b->score; });
  // Per sampled step, the module's weights together (a layer-scale gamma that starts at 1e-5
  // and grows 100x weighs nothing beside the matrices).
  std::map<std::int64_t, double> sumsq;
  std::map<std::int64_t, std::int64_t> values;
  const auto sample = [&](const std::string& module) {
    sumsq.clear();
    values.clear();
    for (const auto& w : run.weight_norms) {
      const auto& layer = run.layers[std::size_t(w.layer_id)].info;
      if (!module.empty() && !suggest::within(layer.module_path, module)) continue;
      sumsq[w.step] += w.l2 * w.l2;
      values[w.step] += layer.numel;
    }
  };
  std::string module;
  bool named = false;
  for (const Finding* f : overflows) {
    sample(f->module);
    if (!sumsq.empty()) {
      module = f->module;
      named = true;
      break;
    }
  }
  if (!named) sample("");
  auto at = sumsq.upper_bound(last);  // the last sample at or before it
  if (at == sumsq.begin()) return;
  --at;
  auto start = sumsq.lower_bound(at->first - kWindow);
  // Skipped steps leave the weights alone: the growth ended where they stopped moving, and
  // began where they first moved (a run whose first steps were all skipped grew from there).
  while (at != start && std::prev(at)->second == at->second) --at;
  const std::int64_t window_start = start->first;
  while (start != at && std::next(start)->second == start->second) ++start;
  // Weights that start near zero (a layer scale at 1e-5, a zero-initialised adapter) are
  // meant to grow many times over: only weights that start at a trained magnitude count.
  const bool moved =
      start != at && rms_at(start->second, values, start->first) >= kLeast;
  double growth = moved ? std::sqrt(at->second / start->second) : 0.0;
  // Or steps of about the weights' own size that the loss rose with: in the module, else in
  // the module whose weights grew the most so (a Mask R-CNN from scratch at SGD 0.01: its
  // stem convolution 11x in one step as the loss went from 10 to 21, while the first to
  // overflow was an FPN block whose weights barely moved; in FP32 it diverged too).
  std::map<std::int64_t, double> losses;
  std::set<std::int64_t> applied;
  for (const auto& s : run.steps) {
    if (run.loss_known(s.row)) losses[s.row.step] = s.row.loss;
    if (!s.row.skipped) applied.insert(s.row.step);
  }
  Jump jump = moved ? steepest_jump(sumsq, values, losses, applied, start->first, at->first) : Jump{};
  bool scanned = false;  // the module is the one whose weights grew the most so, not the overflow's
  if (!(growth >= kGrew) && !(jump.per_step >= kJump)) {
    std::set<std::string> modules;
    for (const auto& w : run.weight_norms) modules.insert(run.layers[std::size_t(w.layer_id)].info.module_path);
    std::string steepest;
    for (const std::string& path : modules) {
      if (path.empty() || path == module) continue;
      sample(path);
      const Jump j = steepest_jump(sumsq, values, losses, applied, last - kWindow, last);
      if (j.per_step >= kJump && j.per_step > jump.per_step) {
        jump = j;
        steepest = path;
      }
    }
    if (steepest.empty()) return;
    module = steepest;
    named = true;
    sample(module);
    start = sumsq.find(jump.from);
    at = sumsq.find(jump.to);
    growth = jump.total;
    scanned = true;
  }
  const bool jumped = jump.per_step >= kJump;

  // Where every skip only calibrated the scale or answered its growth probes, the scale
  // stayed above the floor and no step went on with NaN/Inf, the growth harmed nothing:
  // weights normalised in the forward (an ArcFace head's class centres, F.normalize(W) from
  // 0.01 * randn, whose gradient is 1 / |W| times larger) grow by design until their steps
  // shrink, and the loss falls.
  // A LibTorch MLP at AdamW lr=0.3: a cross-entropy of 2.3 became 299 in one step, and the
  // scaler's nine halvings stopped at the floor of 128, which on one CPU's kernels had read as
  // calibration only.
  bool harmed = harmful_skips(run) > 0 || scale_collapsed(run, t) ||
                (jumped && jump.loss_after >= kLossDiverged * jump.loss_before);
  for (const auto& s : run.steps)
    harmed = harmed || (!s.row.skipped && (run.loss_nonfinite(s.row) || s.gradients_nonfinite()));
  const std::string what = named ? module + "'s weights" : "the model's weights";
  const rundb::EventRow* settings = settings_at(run, at->first);
  const rundb::EventRow* first_settings = run.first_event("optimizer-settings");
  const bool scheduled = settings != first_settings;
  Finding f;
  f.rule = "weight-growth";
  f.severity = harmed ? Severity::kError : Severity::kInfo;
  f.score = harmed ? 102.0 : 5.0;  // before the overflows it causes (scale-collapse 100)
  f.module = named ? module : "";
  f.steps = {start->first, at->first};
  // Gradients that a module without parameters sent back enlarged (a gradient reversal's
  // lambda far above 1): the steps are that large because of its code, not the learning rate.
  const std::optional<SenderCode> sender = named ? sender_code_in(run, out, module) : std::nullopt;
  const bool by_growth = (growth >= kGrew && !scanned) || !jumped;
  const std::string grew = by_growth ? times(growth) + " in " + plural(at->first - start->first, "step")
                                     : times(jump.total) + jump.span();
  f.title = "The weights grew " + grew +
            (harmed ? " while the run overflowed: the optimizer's steps are far too large" +
                          (sender ? ", on gradients " + sender->sender + "'s backward enlarges" : std::string())
                    : " while the scaler calibrated; the loss scale copes with it");
  f.evidence = what + " (L2 norm, all their parameters together) went from " + fmt(std::sqrt(start->second)) +
               " at step " + std::to_string(start->first) + " to " + fmt(std::sqrt(at->second)) + " at step " +
               std::to_string(at->first) +
               (jumped ? ", " + times(jump.total) +
                             jump.span() + ", the loss " + fmt(jump.loss_before) + " at step " +
                             std::to_string(jump.from) + " and " + fmt(jump.loss_after) + " at step " +
                             std::to_string(jump.to) + ": " + (jump.steps == 1 ? "a step" : "steps") +
                             " of about their own size"
                       : std::string()) +
               "; NaN/Inf or skipped steps until step " + std::to_string(last) +
               (settings != nullptr ? "; optimizer: " + settings->detail : std::string()) +
               (scheduled ? " at step " + std::to_string(settings->step) + " (" + lr_of(first_settings->detail) +
                                " at step " + std::to_string(first_settings->step) + ": a schedule moved it)"
                          : std::string()) +
               (harmed ? ". The overflows are where the growth left fp16's range, not why" : "");
  if (sender)
    f.evidence += "; at step " + std::to_string(sender->step) + " " + sender->sender + ", given " + module +
                  "'s output, received a finite gradient at its own output and sent NaN/Inf back to it, and it holds "
                  "no parameters: its code enlarges the gradients " + module + " and the layers before it step on";
  if (!harmed) {
    f.evidence += "; every skip only calibrated the loss scale or answered its growth probes, the scale stayed above "
                  "the floor of " + fmt(t.scale_floor) + " and no step went on with NaN/Inf: weights normalised in the "
                  "forward grow so by design, as their steps shrink with 1 / their norm";
    out.push_back(f);
    return;
  }
  const std::string summary =
      "Lower the learning rate (or warm it up): each step moves the weights so far that they and the activations "
      "they make grow until the half-precision range ends. Pinning the module that overflows first to FP32 only "
      "moves the overflow on.";
  const auto [python, cpp] = lower_lr(settings, scheduled);
  if (sender) f.suggestions.push_back(sender->look);
  f.suggestions.push_back({summary, python, cpp, ""});
  // Pointed to from the window's first step: calibration skips before the weights moved are
  // part of the same run of overflows. Hence the growth's steps, not "after it".
  point_to_cause(out, window_start, "The weights were growing (see weight-growth): ",
                 what + " grew " + times(growth) + " from step " + std::to_string(start->first) + " to step " +
                     std::to_string(at->first));
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
