// overflow-origin (backward) and forward-nonfinite (forward): where NaN/Inf first appear.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include <cstdio>

#include "ampdiag/analyzer/causes.h"
#include "loss_code.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// The largest unscaled gradient of these layers in the steps where they stayed finite, and
// its step (-1: none): above the dtype's maximum, the true gradients do not fit at any scale >= 1.
std::pair<double, std::int64_t> largest_true_gradient(const Run& run, const std::map<std::int64_t, std::int64_t>& layers) {
  std::map<std::int64_t, double> scale_of;
  for (const auto& s : run.steps) scale_of[s.row.step] = s.row.scale_before;
  double largest = 0.0;
  std::int64_t at = -1;
  for (const auto& [id, _] : layers)
    for (const auto& g : run.layers[std::size_t(id)].samples) {
      const auto it = scale_of.find(g.step);
      if (g.nonfinite || it == scale_of.end() || it->second <= 0.0) continue;
      if (const double v = double(g.absmax) / it->second; v > largest) {
        largest = v;
        at = g.step;
      }
    }
  return {largest, at};
}

// The median of the finite recorded losses, NaN where none.
double median_loss(const Run& run) {
  std::vector<double> losses;
  for (const auto& s : run.steps)
    if (run.loss_known(s.row) && std::isfinite(s.row.loss)) losses.push_back(s.row.loss);
  return median_of(losses);
}

std::string step_list(const std::vector<std::int64_t>& steps, std::size_t limit = 6) {
  std::string s;
  for (std::size_t i = 0; i < steps.size() && i < limit; ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  if (steps.size() > limit) s += ", ...";
  return s;
}

// A step whose forward already went non-finite is a forward problem: every gradient is
// NaN then, and "first in backward" would only name the loss's last layer. Not so a module
// that makes NaN/Inf by design (a -inf mask) while the loss stayed finite.
bool forward_failed(const Run& run, const StepSummary& s) {
  return step_cause(run, s).forward != ForwardSource::kNone || run.loss_nonfinite(s.row);
}

// The evidence a replay whose FP32 output was finite gives.
std::string confirmed_evidence(const Run& run, double fp32_absmax) {
  char absmax[48];
  std::snprintf(absmax, sizeof absmax, "%.6g", fp32_absmax);
  if (suggest::beyond_fp16(run, fp32_absmax))
    return std::string("confirmed: re-run once in FP32 on copies of the same inputs, its output was finite but up to ") +
           absmax + ", beyond fp16's largest value (65504): whatever uses it in fp16 overflows next";
  return std::string("confirmed: re-run once in FP32 on copies of the same inputs, its output was finite") +
         (std::isfinite(fp32_absmax) ? std::string(" (max |x| ") + absmax + ")" : "");
}

// Where the loop dropped those batches (event "forward-dropped"): a guard on the loss hides
// the overflow from the scaler and loses the batch, so it is no sign the model absorbed it.
std::string dropped_evidence(std::int64_t dropped) {
  return "the loop dropped the batch in " + plural(dropped, "step") +
         " before backward (no gradient reached the forward that went NaN/Inf: a guard such as "
         "`if not torch.isfinite(loss): continue` loses the batch, it does not avoid the overflow)";
}

// Steps where `module` was the forward's cause and the loss went NaN/Inf.
std::int64_t nonfinite_losses_caused(const Run& run, const std::string& module) {
  std::int64_t n = 0;
  for (const auto& s : run.steps)
    if (nonfinite_from_module(run, s) && run.loss_nonfinite(s.row) &&
        forward_cause(run, run.modules[std::size_t(s.first_nonfinite_module)].info.path).module == module)
      ++n;
  return n;
}

Finding confirmed_overflow(const Run& run, const ModuleSummary& m, const std::string& before, Severity severity,
                           double score) {
  const rundb::ReplayRow* r = run.replay_of(m.info.path);
  Finding f;
  f.rule = "forward-nonfinite";
  f.severity = severity;
  f.module = m.info.path;
  f.confirmation = "confirmed";
  f.score = score;
  f.title = m.info.path + " overflows fp16 in forward, after " + before + "'s NaN/Inf by design";
  f.evidence = "its output was NaN/Inf in " + plural(m.nonfinite_steps, "step") + "; " + confirmed_evidence(run, r->fp32_absmax) +
               "; " + before + ", first in forward order, makes NaN/Inf from finite inputs in FP32 too";
  if (m.first_step >= 0) f.steps.push_back(m.first_step);
  f.suggestions = suggest::confirmed_fixes(run, m.info.path, r->fp32_absmax);
  return f;
}

// The steps whose loss was NaN/Inf although every probed module's output was finite: the
// NaN/Inf was made after the modules, where no replay can look. Empty steps: none. An error
// (for the caller to keep or lower) where the gradients went NaN/Inf with it; a warning
// where they stayed finite (a mean over no element: the step's update was not lost).
Finding loss_after_modules(const Run& run, std::int64_t known_losses) {
  Finding f;
  std::int64_t n = 0, hurt = 0;
  std::vector<std::int64_t> steps;
  for (const auto& s : run.steps) {
    if (step_cause(run, s).forward != ForwardSource::kLoss) continue;
    ++n;
    steps.push_back(s.row.step);
    hurt += s.row.skipped || s.gradients_nonfinite();
  }
  if (n == 0) return f;
  f.steps.push_back(steps.front());
  const loss_code::Code code = loss_code::at_steps(run, steps);
  f.rule = "forward-nonfinite";
  f.severity = hurt ? Severity::kError : Severity::kWarning;
  f.score = hurt ? 80.0 : 30.0;
  f.title = "The loss is NaN/Inf while every probed module's output is finite: it is made after the modules";
  f.blame = "the loss code after the model's last module";
  f.evidence = "loss non-finite in " + std::to_string(n) + " of " + plural(known_losses, "step") + ", first at step " +
               std::to_string(f.steps.front()) + ", with no NaN/Inf in any probed module's output in those steps; " +
               (hurt ? "the gradients went NaN/Inf with it in " + plural(hurt, "step")
                     : std::string("the gradients stayed finite, so no update was lost, but the logged loss is NaN/Inf"));
  if (!code.empty())
    f.evidence += "; the operations from the model's output to the loss (step " + std::to_string(code.step) +
                  "): " + code.describe();
  f.suggestions = loss_code::forward_suggestions(
      code,
      "Look at the code after the model's last module: the loss, and the model's own forward() after its last "
      "submodule. Keep log() and divisions away from 0 (a mean over no element, as when every label is "
      "ignore_index, is 0/0); a sum, pow or exp in fp16 overflows above 65504.");
  // A target (or another model's output) the loss was given already held NaN/Inf.
  if (const loss_code::NonfiniteInput in = loss_code::nonfinite_input_at(run, steps); in.seen > 0) {
    const std::string what = in.op + "'s " + in.argument;
    if (in.seen == in.looked)
      f.title = "The loss is NaN/Inf because " + what + " already held NaN/Inf: not the model, the loss code or fp16";
    f.evidence += "; before backward, the " + in.argument + " given to " + in.op + " held NaN/Inf in " +
                  std::to_string(in.seen) + " of the " + plural(in.looked, "step") + " whose loss code was read (step " +
                  std::to_string(in.step) + ": " + in.counts + ")";
    f.blame = what;
    f.suggestions.insert(
        f.suggestions.begin(),
        {"Find where " + what + " gets NaN/Inf before the loss: a missing value in the dataset (drop or mask such "
             "samples), or another model's output (a teacher, an encoder run under no_grad) that went NaN/Inf; "
             "pinning this model's modules or computing the loss in FP32 cannot help.",
         "keep = torch.isfinite(y).all(-1)  # or fix the data: assert torch.isfinite(y).all()\n"
         "loss = loss_fn(out[keep], y[keep])",
         "auto keep = torch::isfinite(y).all(-1);\nauto loss = loss_fn(out.index({keep}), y.index({keep}));", ""});
    if (in.seen == in.looked) f.suggestions.resize(1);  // nothing else is to blame
  }
  return f;
}

// The steps whose model input held NaN (events "input-nan", written where an output was
// NaN/Inf): a corrupted batch, which no precision change fixes. Empty steps: none.
Finding input_nan(const Run& run) {
  Finding f;
  std::int64_t n = 0, hurt = 0;
  std::string detail;
  for (const auto& s : run.steps) {
    if (step_cause(run, s).forward != ForwardSource::kInput) continue;
    if (n++ == 0) f.steps.push_back(s.row.step);
    hurt += s.row.skipped || run.loss_nonfinite(s.row);
  }
  if (n == 0) return f;
  for (const auto& e : run.events)
    if (e.kind == "input-nan" && e.step == f.steps.front()) detail = e.detail;
  f.rule = "input-nan";
  f.severity = hurt ? Severity::kError : Severity::kInfo;
  f.score = hurt ? 90.0 : 5.0;
  f.title = hurt ? "The model's input already held NaN: none of its modules made the forward non-finite"
                 : "The model's input held NaN, and the loss stayed finite";
  f.evidence = "in " + plural(n, "step") + " with a NaN/Inf output, from step " + std::to_string(f.steps.front()) +
               ", the model's input already held NaN" + (detail.empty() ? "" : " (" + detail + ")") + "; " +
               std::to_string(hurt) + " of them skipped or with a NaN/Inf loss";
  if (hurt)
    f.suggestions.push_back({"Find where the input got its NaN before the model: bad samples in the data pipeline (a "
                             "missing value, a 0/0 in preprocessing), or code that computes it (an encoder run before "
                             "the model under no_grad, as a diffusion model's text encoder: attach one ModuleDict "
                             "holding both to have its modules watched); pinning this model's modules to FP32 cannot "
                             "help.",
                             "assert not torch.isnan(x).any(), \"NaN in the batch\"",
                             "TORCH_CHECK(!torch::isnan(x).any().item<bool>(), \"NaN in the batch\");"});
  return f;
}

// Probed modules holding no parameter that finished their forward after `first`'s module
// and before `last_finite`'s (module ids are given as modules first finish, in forward
// order): a gradient going from one layer to the other in backward passes through their
// backward too. At most a few, by path.
void parameterless_between(const Run& run, const rundb::LayerRow& first, const rundb::LayerRow& last_finite,
                           std::set<std::string>& out) {
  const ModuleSummary* from = run.module_named(first.module_path);
  const ModuleSummary* to = run.module_named(last_finite.module_path);
  if (!from || !to) return;
  for (std::int64_t id = from->info.id + 1; id < to->info.id && out.size() < 3; ++id) {
    const std::string& path = run.modules[std::size_t(id)].info.path;
    const bool holds = std::any_of(run.layers.begin(), run.layers.end(), [&](const LayerSummary& l) {
      return l.info.module_path == path || l.info.name.rfind(path + ".", 0) == 0;
    });
    if (!holds) out.insert(path);
  }
}

// (step, layer name) -> the module whose use of that tied parameter went NaN/Inf first in
// the step (the agent's event "tied-gradient-nonfinite": "emb.weight through head").
using TiedUses = std::map<std::pair<std::int64_t, std::string>, std::string>;

TiedUses tied_uses(const Run& run) {
  TiedUses uses;
  static const std::string kThrough = " through ";
  for (const auto& e : run.events) {
    if (e.kind != "tied-gradient-nonfinite") continue;
    const std::size_t at = e.detail.find(kThrough);
    if (at == std::string::npos) continue;
    const std::string module = e.detail.substr(at + kThrough.size());
    uses.emplace(std::make_pair(e.step, e.detail.substr(0, at)), module == "the model" ? "" : module);
  }
  return uses;
}

// The agent's replay of a module's backward (event "backward-replay", "PATH: OUTCOME:
// DETAIL", see the Python agent's _backward_replay.py): outcome "finite" (NaN/Inf as it
// ran, none in FP32), "intrinsic" (NaN/Inf in FP32 from finite values) or "unconfirmed";
// empty where none ran for it.
struct BackwardReplay {
  std::string outcome, detail;
  std::int64_t step = -1;
};

BackwardReplay backward_replay(const Run& run, const std::string& module) {
  if (module.empty()) return {};
  const auto [e, rest] = run.module_event("backward-replay", module);
  if (!e) return {};
  const std::size_t at = rest.find(": ");
  return {rest.substr(0, at), at == std::string::npos ? std::string() : rest.substr(at + 2), e->step};
}

// Skipped steps whose NaN/Inf gradients no hook saw arrive: naming a first one would be a
// guess, so none is named and no pin suggested.
Finding unordered_overflow(const Run& run, const std::vector<std::int64_t>& steps, bool hurts) {
  Finding f;
  f.rule = "overflow-origin";
  f.severity = hurts ? Severity::kWarning : Severity::kInfo;
  f.score = hurts ? 40.0 : 1.0;
  f.title = "The gradients went NaN/Inf in " + plural(std::int64_t(steps.size()), "skipped step") +
            ", but no backward order was recorded: which layer overflowed first is unknown";
  f.evidence = "no gradient hook saw them arrive (steps " + step_list(steps) + ")";
  if (run.first_event("sharded-parameters"))
    f.evidence += "; the parameters are sharded (FSDP2): their gradients are set after the reduce-scatter, where the "
                  "agent sees no arrival, and the reduce-scatter spreads a NaN to every layer it sums";
  f.steps.assign(steps.begin(), steps.begin() + std::min<std::size_t>(steps.size(), 20));
  f.suggestions.push_back({"Train a few steps of the same loop unsharded on one process (without fully_shard), where "
                           "the agent records the backward order and names the layer; the forward's findings still hold.",
                           "", ""});
  return f;
}

}  // namespace

void overflow_origin(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  // Overflows that only calibrate the scale or answer its growth probes are the scaler
  // working as designed: still reported, as information.
  // A module whose every skip was one of those is information even where other skips (a
  // forward NaN's) push the run's skip rate up, unless the scale collapsed.
  const bool hurts = overflow_hurts(run, t), collapsed = scale_collapsed(run, t);
  const std::vector<bool> harmful = harmful_skip_mask(run);
  struct PerModule {
    std::int64_t first = 0, harmful = 0;
    std::map<std::int64_t, std::int64_t> layers;  // layer id -> times first
    std::vector<std::int64_t> steps;
    double lowest_scale = INFINITY;  // the lowest loss scale it went NaN/Inf at
    std::int64_t below_floor = 0;    // steps it was first in at a scale below the floor
    std::set<std::string> between;   // parameterless modules the gradient passed on its way
    std::set<std::string> tied;      // its layers that another module holds too, first in its use
  };
  std::map<std::string, PerModule> modules;
  std::int64_t considered = 0;
  std::vector<std::int64_t> unordered;  // skipped steps whose first NaN/Inf gradient is unknown
  const bool half_loss = has_half_loss(run);
  const TiedUses tied = tied_uses(run);
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepSummary& s = run.steps[i];
    if (!s.row.skipped || s.nonfinite_layers.empty() || forward_failed(run, s)) continue;
    if (half_loss && half_loss_skip(s)) continue;  // the loss's gradient overflowed: half-loss says so
    if (!s.nonfinite_ordered) {
      unordered.push_back(s.row.step);
      continue;
    }
    ++considered;
    const std::int64_t first_layer = s.nonfinite_layers.front();
    // A tied parameter (an LM's embedding and head) first went NaN/Inf in one module's use
    // of it: that module is where the backward overflowed, not the one it is registered under.
    rundb::LayerRow layer = run.layers[std::size_t(first_layer)].info;
    const auto use = tied.find({s.row.step, layer.name});
    if (use != tied.end()) layer.module_path = use->second;
    // The overflow happened in backward between the last finite gradient and this one: in
    // the innermost module holding both, unless that is only the model itself.
    std::string module = use != tied.end() ? use->second : suggest::module_for_layer(run, layer);
    if (s.last_finite_before >= 0) {
      const std::string common =
          suggest::common_module(run.layers[std::size_t(s.last_finite_before)].info.module_path, layer.module_path);
      if (!common.empty()) module = common;
    }
    PerModule& m = modules[module];
    ++m.first;
    m.harmful += harmful[i];
    ++m.layers[first_layer];
    if (layer.module_path != run.layers[std::size_t(first_layer)].info.module_path) m.tied.insert(layer.name);
    m.lowest_scale = std::min(m.lowest_scale, s.row.scale_before);
    m.below_floor += s.row.scale_before < t.scale_floor;
    if (s.last_finite_before >= 0)
      parameterless_between(run, layer, run.layers[std::size_t(s.last_finite_before)].info, m.between);
    m.steps.push_back(s.row.step);
  }
  std::vector<std::pair<std::string, PerModule>> ranked(modules.begin(), modules.end());
  // Under a collapsed scale (its skips may all count as calibration) the module that went
  // first most often below the floor is what holds the scale there: one first only at
  // higher scales stopped overflowing as the scale fell (one before it in backward order
  // that kept overflowing would have stayed first).
  const auto rank = [collapsed](const PerModule& m) {
    return std::make_tuple(!collapsed && m.harmful == 0, collapsed ? -m.below_floor : 0, -m.harmful, -m.first);
  };
  std::stable_sort(ranked.begin(), ranked.end(),
                   [&](const auto& a, const auto& b) { return rank(a.second) < rank(b.second); });
  bool top = true;
  for (const auto& [module, m] : ranked) {
    const bool harms = hurts && (collapsed || m.harmful > 0);
    const auto layer = std::max_element(m.layers.begin(), m.layers.end(),
                                        [](const auto& a, const auto& b) { return a.second < b.second; });
    const rundb::LayerRow& row = run.layers[std::size_t(layer->first)].info;
    std::string place = suggest::place_of(module, row);
    if (place.rfind("the ", 0) == 0) place[0] = 'T';  // a title's first word
    Finding f;
    f.rule = "overflow-origin";
    f.severity = !harms ? Severity::kInfo : (top ? Severity::kError : Severity::kWarning);
    f.module = module;
    f.layer = row.name;
    const double share = double(m.first) / double(considered);
    f.score = 90.0 * share + (top ? 5.0 : 0.0);
    f.title = place + " overflows first in backward: its gradients go non-finite before any other layer's";
    // Several of its gradients were first in different steps: each with its own count.
    std::string which;
    if (m.layers.size() > 1) {
      std::vector<std::pair<std::int64_t, std::int64_t>> by_count(m.layers.begin(), m.layers.end());
      std::stable_sort(by_count.begin(), by_count.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
      for (std::size_t k = 0; k < by_count.size() && k < 4; ++k)
        which += run.layers[std::size_t(by_count[k].first)].info.name + " in " + std::to_string(by_count[k].second) + ", ";
      if (by_count.size() > 4) which += "..., ";
      which.replace(which.size() - 2, 2, "; ");
    }
    f.evidence = (m.layers.size() == 1 ? row.name + " was the first gradient"
                                       : "a gradient of " + (module.empty() ? std::string("the model") : module) +
                                             " was the first") +
                 " (in backward order) to hold NaN/Inf in " + std::to_string(m.first) + " of " +
                 plural(considered, "skipped step") + " (" + which + (m.steps.size() == 1 ? "step " : "steps ") +
                 step_list(m.steps) + ")";
    for (const std::string& name : m.tied)
      f.evidence += "; " + name +
                    (module.empty() ? " is used by the model's own forward() besides its module: that use"
                                    : " is tied (one tensor held by several modules): " + module + "'s use of it") +
                    " went NaN/Inf first, before its other uses added theirs";
    if (!harms) {
      f.title = place + " is where the occasional overflow starts; the loss scale copes with it";
      f.evidence += "; the scale stays above the floor and these skips only calibrate it or answer its growth probes";
    }
    f.steps.assign(m.steps.begin(), m.steps.begin() + std::min<std::size_t>(m.steps.size(), 20));
    // At a scale of 1 or below the scaler no longer enlarges the gradients: going NaN/Inf
    // there takes a true gradient beyond fp16's range, or a NaN its backward makes in any
    // precision (sqrt or norm of 0), which pinning cannot help. Neither is ruled out.
    const bool at_any_scale = harms && run.has_scaler() && m.lowest_scale <= 1.0;
    // Where its finite steps show gradients beyond fp16's range unscaled, that is why.
    const auto [true_max, true_max_step] =
        at_any_scale && run.fp16() ? largest_true_gradient(run, m.layers) : std::pair<double, std::int64_t>{0.0, -1};
    const bool too_large = true_max > run.fp_max;
    if (too_large) {
      f.title = place + "'s gradients exceed fp16's range even unscaled (up to " + fmt(true_max) + ")";
      f.evidence += "; in the steps where they stayed finite the largest unscaled one was " + fmt(true_max) + " (step " +
                    std::to_string(true_max_step) + "), above fp16's 65504: the scale has to stay below 1 to fit them "
                    "(they overflowed down to " + fmt(m.lowest_scale) + "), which flushes the small ones to zero";
      const double loss = median_loss(run);
      f.suggestions.push_back(
          {"Shrink the loss where it is made" +
               (std::isfinite(loss) ? " (it is around " + fmt(loss) + ", and its gradients are as large)" : std::string()) +
               ": normalise the regression targets to unit spread, average over the batch instead of summing, or "
               "divide the loss by a constant.",
           "y = (y - y_mean) / y_std  # targets in units of their spread (predictions: * y_std + y_mean)\n"
           "loss = loss_fn(model(x).float(), y)",
           "auto y_n = (y - y_mean) / y_std;  // predictions: * y_std + y_mean\n"
           "auto loss = loss_fn(model->forward(x).to(torch::kFloat), y_n);",
           ""});
    }
    const BackwardReplay replay = at_any_scale && !too_large ? backward_replay(run, module) : BackwardReplay{};
    if (at_any_scale && !too_large) {
      f.title = place + " goes NaN/Inf first in backward at every loss scale, down to " + fmt(m.lowest_scale);
      f.evidence += "; down to a loss scale of " + fmt(m.lowest_scale) + ", which no longer enlarges the gradients";
      if (replay.outcome == "finite") {
        f.title += "; in FP32 its backward is finite (replayed)";
        f.evidence += ": its backward, replayed at step " + std::to_string(replay.step) +
                      " on that call's inputs and output gradient, went NaN/Inf as it ran and not in FP32 (" +
                      replay.detail + "): a value inside it passes fp16's range (an intermediate that overflows and is "
                      "then squashed: tanh of an Inf is 1, and its gradient 0 * Inf is NaN; or a gradient inside it "
                      "beyond 65504)";
      } else if (replay.outcome == "intrinsic") {
        f.title += "; its backward makes NaN/Inf in FP32 too (replayed)";
        f.evidence += ": its backward, replayed at step " + std::to_string(replay.step) +
                      " on that call's finite inputs and output gradient, went NaN/Inf in FP32 too (" + replay.detail +
                      "): it makes them in any precision";
      } else {
        f.evidence += ": its backward makes NaN/Inf that no scale avoids, or its true gradients pass fp16's range";
        if (!replay.outcome.empty()) f.evidence += " (its backward replay could not tell: " + replay.detail + ")";
      }
      std::string suspects;
      for (const auto& path : m.between) suspects += path + ", ";
      if (!m.between.empty())
        f.evidence += "; between its gradient and the last finite one, the backward also ran through " +
                      suspects.substr(0, suspects.size() - 2) +
                      (m.between.size() == 1 ? ", which holds no parameters" : ", which hold no parameters");
      suspects += module.empty() ? std::string("the code that uses ") + row.name : module;
      if (replay.outcome != "finite")
        f.suggestions.push_back(
            {"Look first at the backward of " + suspects +
                 ": a function whose gradient is infinite where it is evaluated (sqrt or norm of 0, a division by 0, "
                 "log of 0) makes NaN from finite values in any precision, which pinning cannot help; keep its "
                 "argument off that point (sqrt(x + 1e-12)).",
             "d = (x.pow(2).sum(-1) + 1e-12).sqrt()  # sqrt(0)'s gradient is infinite",
             "auto d = (x.pow(2).sum(-1) + 1e-12).sqrt();  // sqrt(0)'s gradient is infinite", ""});
    }
    if (harms && replay.outcome != "intrinsic") {  // nothing to fix when the scaler copes
      f.suggestions.push_back(suggest::fp32_at(run, module, row));
      if (at_any_scale && !too_large && replay.outcome != "finite")
        f.suggestions.back().summary = "If its true gradients are the ones beyond fp16: " + f.suggestions.back().summary;
      f.suggestions.push_back(suggest::use_bf16(run));
    }
    out.push_back(f);
    top = top && !harms;
  }
  if (considered == 0 && !unordered.empty()) out.push_back(unordered_overflow(run, unordered, hurts));
}

// Where in `owner`'s own code (the model's: "") the NaN/Inf that `first_seen` received was
// made: "between A and first_seen", A the module inside `owner` that finished just before
// it in forward order (its output was finite, or it would have been first); "before
// first_seen" where none inside `owner` did.
// The module that first finished just before `path` (module ids are given in that order):
// null where `path` is no module or the first.
const ModuleSummary* finished_before(const Run& run, const std::string& path) {
  const ModuleSummary* m = run.module_named(path);
  return m && m->info.id > 0 ? &run.modules[std::size_t(m->info.id - 1)] : nullptr;
}

std::string own_code_place(const Run& run, const std::string& owner, const std::string& first_seen) {
  if (!run.module_named(first_seen)) return "";
  if (const ModuleSummary* before = finished_before(run, first_seen)) {
    const std::string& path = before->info.path;
    if (owner.empty() || path.rfind(owner + ".", 0) == 0) return "between " + path + " and " + first_seen;
  }
  return "before " + first_seen;
}

// The module's buffers that held NaN when its FP32 replay made NaN from finite inputs
// (event "buffers-nan", "PATH: running_var (1 of 8 values NaN)"): the part after "PATH: ";
// empty where none did.
std::string nan_buffers(const Run& run, const std::string& path) { return run.module_event("buffers-nan", path).second; }

// Replacing them: a BatchNorm's running statistics are reset (and recomputed in train
// mode); any other buffer is named for the user to restore.
Suggestion buffers_fix(const Run&, const std::string& path, const std::string& buffers) {
  const std::string name = path.empty() ? "the model" : path;
  if (buffers.find("running_var") != std::string::npos || buffers.find("running_mean") != std::string::npos)
    return {"Reset " + name + "'s running statistics, which a checkpoint saved after a NaN batch (or an earlier step's "
                "NaN in train mode) left NaN: reset_running_stats(), then a few batches in train mode to recompute "
                "them, or load a checkpoint from before; pinning it to FP32 cannot help.",
            suggest::python_attribute(path) + ".reset_running_stats()",
            "// the BatchNorm module at " + path + ":\nbn->reset_running_stats();", ""};
  return {"Restore " + name + "'s buffers (" + buffers +
              "): a checkpoint, or an earlier step's NaN, wrote NaN into them, and every output made from them is NaN; "
              "pinning it to FP32 cannot help.",
          "", "", ""};
}

// The model's own output NaN/Inf while every module's output was finite (the Python agent
// records it as module "", the model, with its FP32 replay): made by the model's forward()
// after its last module, as logits computed with F.linear(h, self.emb.weight). Names that
// module and the operations after it (event "model-code") and tells to run them in FP32.
void model_code_after_modules(const Run& run, const std::vector<std::int64_t>& steps, Finding& f) {
  const ModuleSummary* before = finished_before(run, "");  // the model's row comes after its modules'
  const std::string last = before ? before->info.path : "";
  const std::string after = last.empty() ? "after its last submodule" : "after " + last + ", its last submodule";
  const loss_code::Code code = loss_code::at_steps(run, steps, "model-code");
  f.title = "The model's output is NaN/Inf while every module's output is finite: its own forward() makes it " + after;
  if (!code.empty())
    f.evidence += "; the operations from " + (last.empty() ? std::string("its last submodule") : last) +
                  "'s output to the model's (step " + std::to_string(code.step) + "): " + code.describe();
  f.suggestions.push_back(suggest::fp32_model_code(run, after, code.float16_compute()));
}

void forward_nonfinite(const Run& run, const Thresholds&, std::vector<Finding>& out) {
  std::int64_t nonfinite_loss = 0, first_bad_loss = -1, known_losses = 0;
  for (const auto& s : run.steps) {
    if (!run.loss_known(s.row)) continue;
    ++known_losses;
    if (!std::isfinite(s.row.loss)) {
      ++nonfinite_loss;
      if (first_bad_loss < 0) first_bad_loss = s.row.step;
    }
  }
  struct Culprit {
    ForwardCause cause;
    std::int64_t first = 0, first_step = -1;
    std::int64_t hurt = 0;     // of those steps, skipped, dropped, or with NaN/Inf gradients or loss
    std::int64_t absorbed = 0;     // of those steps, none of that
    std::int64_t calibration = 0;  // of the hurt ones, the scale's calibration skips (the loss finite)
    std::int64_t dropped = 0;  // of those steps, where the loop dropped the batch (forward-dropped)
    std::int64_t evaluations = 0;  // of those steps, where it was an evaluation's forward (evaluation-nonfinite)
    std::vector<std::int64_t> steps;  // ascending
  };
  // Steps whose input held NaN are the data's (input-nan), whatever module showed it first,
  // and those after an update that wrote NaN/Inf into the parameters are its (nonfinite-update).
  std::map<std::string, Culprit> culprits;
  std::map<std::int64_t, ForwardCause> cause_of;  // by module id
  std::int64_t with_module = 0;
  const std::vector<bool> harmful = harmful_skip_mask(run);
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepSummary& s = run.steps[i];
    if (!nonfinite_from_module(run, s)) continue;
    ++with_module;
    auto it = cause_of.find(s.first_nonfinite_module);
    if (it == cause_of.end())
      it = cause_of.emplace(s.first_nonfinite_module,
                            forward_cause(run, run.modules[std::size_t(s.first_nonfinite_module)].info.path)).first;
    Culprit& c = culprits[it->second.module];
    if (c.first++ == 0) c.cause = it->second;
    if (c.first_step < 0 || s.row.step < c.first_step) c.first_step = s.row.step;
    c.steps.push_back(s.row.step);
    // A batch the loop dropped before backward is lost to the overflow as a skipped step is.
    const bool dropped = run.forward_dropped(s.row.step);
    c.dropped += dropped;
    c.evaluations += run.evaluation_nonfinite(s.row.step);
    const bool hurt = dropped || s.row.skipped || s.gradients_nonfinite() || run.loss_nonfinite(s.row);
    c.hurt += hurt;
    c.absorbed += !hurt;
    c.calibration += hurt && s.row.skipped && !harmful[i] && !dropped && !run.loss_nonfinite(s.row);
  }
  // Where the model absorbed the NaN/Inf in some steps (a tanh or a clamp after it), the
  // scaler's skips while it finds its level, with a finite loss, are the gradients'
  // overflow at a scale still too high, not this output's.
  for (auto& [path, c] : culprits)
    if (c.absorbed > 0) c.hurt -= c.calibration;
  std::vector<std::pair<std::string, Culprit>> ranked(culprits.begin(), culprits.end());
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return (a.second.hurt > 0) != (b.second.hurt > 0) ? a.second.hurt > 0 : a.second.first > b.second.first;
  });
  bool top = true;
  for (const auto& [path, c] : ranked) {
    const ForwardCause& cause = c.cause;
    const std::string name = path.empty() ? "the model's own forward()" : path;
    Finding f;
    f.rule = "forward-nonfinite";
    f.severity = top ? Severity::kError : Severity::kWarning;
    f.module = path;
    f.confirmation = cause.confirmation;
    f.score = 95.0 * double(c.first) / double(std::max<std::int64_t>(1, with_module)) + (top ? 5.0 : 0.0);
    f.title = name + " is the first module whose output is NaN/Inf in forward";
    const std::string where = cause.own_code ? own_code_place(run, path, cause.first_seen) : "";
    if (cause.own_code)
      f.title = (path.empty() ? "The first NaN/Inf in forward is made in the model's own forward(), outside its submodules"
                              : path + " produces the first NaN/Inf in forward, in its own code") +
                (where.empty() ? "" : ", " + where);
    f.evidence = "first non-finite output in forward order in " + std::to_string(c.first) + " of " +
                 plural(std::int64_t(run.steps.size()), "step") + ", from step " + std::to_string(c.first_step);
    f.steps.push_back(c.first_step);
    // Where the loop dropped the batches, their losses never reached the agent: no count to give.
    if (nonfinite_loss > 0) f.evidence += "; the loss was NaN/Inf in " + plural(nonfinite_loss, "step");
    if (c.dropped > 0) f.evidence += "; " + dropped_evidence(c.dropped);
    if (c.evaluations > 0)
      f.evidence += "; in " + plural(c.evaluations, "step") +
                    " it went NaN/Inf in an evaluation (the model in eval mode with gradients on), which trains nothing";
    if (cause.own_code)
      f.evidence += "; " + cause.first_seen + " showed it first but only received it (its FP32 replay was still NaN/Inf)";
    if (cause.confirmation == "confirmed") {
      f.evidence += "; " + confirmed_evidence(run, cause.fp32_absmax);
      f.score += 1.0;
    } else if (cause.confirmation == "unconfirmed") {
      f.evidence += "; unconfirmed: " + cause.reason;
    }
    if (cause.intrinsic) {
      // Not fp16's range: pinning cannot help, and a mask whose -inf the model absorbs
      // (the loss stayed finite) is no problem at all.
      const std::int64_t lost = nonfinite_losses_caused(run, path), hurt = lost + c.dropped;
      // Where the loss went NaN/Inf, a module after it that overflowed fp16 may have made it so.
      const ModuleSummary* after = hurt ? overflow_after_intrinsic(run) : nullptr;
      if (hurt == 0 || after) {
        if (after) {
          out.push_back(confirmed_overflow(run, *after, name, top ? Severity::kError : Severity::kWarning, f.score + 1.0));
          top = false;
        }
        f.severity = Severity::kInfo;
        f.score = 5.0;
        f.title = name + " outputs NaN/Inf from finite inputs, in FP32 too" +
                  (after ? "" : ", and the loss stays finite") + ": by design (a -inf mask), not an overflow";
        f.evidence += after ? "; the NaN/Inf that reached the loss came from " + after->info.path : "; the loss stayed finite";
        out.push_back(f);
        continue;  // the next culprit, if any, is the top one
      }
      if (lost > 0) f.evidence += "; the loss was NaN/Inf in " + plural(lost, "step") + " it started";
      f.blame = name;  // what a symptom's fix points to: no overflow
      if (const std::string buffers = nan_buffers(run, path); !buffers.empty()) {
        f.title = name + " makes NaN from finite inputs because its buffers hold NaN, not its code or fp16's range";
        f.evidence += "; when its FP32 replay ran, its buffers held NaN: " + buffers;
        f.suggestions.push_back(buffers_fix(run, path, buffers));
      } else {
        f.title = name + " makes NaN/Inf from finite inputs even in FP32: its code, not fp16's range";
        f.suggestions.push_back({"Look at " + name + "'s code: from finite inputs it returns NaN/Inf in FP32 too (a log or "
                                 "a division by 0, an exp beyond float32, an inf fill, a softmax over a row whose every "
                                 "entry is masked: an empty sequence in a padding mask); pinning it to FP32 cannot help.",
                                 "", ""});
      }
      out.push_back(f);
      top = false;
      continue;
    }
    // A replayed module's fixes carry their own bf16 line.
    const bool replayed_pin = !path.empty() && cause.confirmation == "confirmed";
    if (replayed_pin) {
      f.suggestions = suggest::confirmed_fixes(run, path, cause.fp32_absmax);
    } else if (!path.empty()) {
      f.suggestions.push_back(suggest::pin_fp32(run, path));
    } else if (!cause.own_code) {
      model_code_after_modules(run, c.steps, f);
    } else {
      f.suggestions.push_back({"Look at the model's own forward() " + (where.empty() ? "between its submodules" : where) +
                                   ": the NaN/Inf is made there, outside any module ampdiag hooks (an exp, a division "
                                   "or a sum in fp16; wrap that code in a module to have it named).",
                               "", ""});
    }
    if (run.fp16() && !replayed_pin) f.suggestions.push_back(suggest::use_bf16(run));
    if (c.hurt == 0) {
      // The model absorbed it (a max, a mask): a latent overflow, not a lost step. Or only
      // evaluations showed it, which train nothing.
      f.severity = Severity::kWarning;
      if (c.evaluations < c.first && c.calibration > 0 && c.absorbed > 0)
        f.evidence += "; the model absorbed it: the loss stayed finite in those steps, and the only ones skipped (" +
                      std::to_string(c.calibration) + ") were the loss scale's calibration";
      else if (c.evaluations < c.first)
        f.evidence += "; the model absorbed it: none of those steps was skipped or had NaN/Inf gradients or loss";
    }
    out.push_back(f);
    top = top && c.hurt == 0;
  }
  if (Finding f = input_nan(run); !f.steps.empty()) out.push_back(f);
  if (!run.modules.empty()) {
    if (Finding f = loss_after_modules(run, known_losses); f.steps.size() > 0) {
      if (!top) f.severity = Severity::kWarning;
      out.push_back(f);
    }
  } else if (nonfinite_loss > 0) {
    Finding f;
    f.rule = "forward-nonfinite";
    f.severity = Severity::kError;
    f.score = 80.0;
    f.title = "The loss is NaN/Inf, but no module output was probed to say where it started";
    f.evidence = "loss non-finite in " + std::to_string(nonfinite_loss) + " of " + plural(known_losses, "step") +
                 ", first at step " + std::to_string(first_bad_loss);
    f.steps.push_back(first_bad_loss);
    if (run.first_event("compiled-after-attach")) {
      // The hooks were there, and torch.compile traced them into its graph, where they do nothing.
      f.evidence += "; the model was compiled with torch.compile after attach(), so its forward was not watched";
      f.suggestions.push_back({"Call attach() after torch.compile: the compiled model's hooks then run outside its graph.",
                               "model = torch.compile(model)\nhandle = ampdiag.attach(model, scaler)", ""});
    } else {
      f.suggestions.push_back({"Record activations: in Python attach with activations=True (the default); in C++ wrap "
                               "module outputs with agent.probe(\"path\", x).",
                               "handle = ampdiag.attach(model, scaler, activations=True)", "x = agent.probe(\"encoder.0\", x);"});
    }
    out.push_back(f);
  }
}

}  // namespace ampdiag::analyzer::rules
