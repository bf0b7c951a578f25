// overflow-origin: where NaN/Inf first appear in backward (forward-nonfinite: rules_forward.cpp).
#include <algorithm>
#include <cctype>
#include <iterator>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <cstdio>

#include "ampdiag/analyzer/causes.h"
#include "ampdiag/rundb/module_paths.h"
#include "backward_order.h"
#include "code_after_fixes.h"
#include "loss_code.h"
#include "loss_size_fixes.h"
#include "overflow_events.h"
#include "own_overflows.h"
#include "rules.h"
#include "suggestions.h"
#include "true_gradients.h"

namespace ampdiag::analyzer::rules {

namespace {

// The key counted most often; "" for none.
std::string most_often(const std::map<std::string, std::int64_t>& counts) {
  const auto top = std::max_element(counts.begin(), counts.end(),
                                    [](const auto& a, const auto& b) { return a.second < b.second; });
  return top == counts.end() ? "" : top->first;
}

// "the run's skips, 8 of 80 steps," as the skip rate counts them: where the scaler's
// calibration or growth probes skipped steps too, the raw count is larger, and says so.
std::string counted_skips(const Run& run) {
  const std::int64_t all = std::int64_t(run.steps.size());
  const std::int64_t skipped = std::count_if(run.steps.begin(), run.steps.end(), [](const StepSummary& s) { return s.row.skipped; });
  const std::int64_t counted = harmful_skips(run), considered = all - calibration_skips(run);
  if (counted == skipped) return "the run's skips, " + std::to_string(counted) + " of " + plural(considered, "step") + ",";
  return "the run's skips, not counting those that calibrated the scale or answered its growth probes, " +
         std::to_string(counted) + " of " + plural(considered, "step") + " (" + std::to_string(skipped) + " of " +
         std::to_string(all) + " with them),";
}

// A step whose forward already went non-finite is a forward problem: every gradient is
// NaN then, and "first in backward" would only name the loss's last layer. Not so a module
// that makes NaN/Inf by design (a -inf mask) while the loss stayed finite.
bool forward_failed(const Run& run, const StepSummary& s) {
  return step_cause(run, s).forward != ForwardSource::kNone || run.loss_nonfinite(s.row);
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
    f.evidence += "; the parameters are sharded (FSDP): their gradients are set after the reduce-scatter, where the "
                  "agent sees no arrival, and the reduce-scatter spreads a NaN to every layer it sums";
  f.steps.assign(steps.begin(), steps.begin() + std::min<std::size_t>(steps.size(), 20));
  f.suggestions.push_back({"Train a few steps of the same loop unsharded on one process (without fully_shard or "
                           "FullyShardedDataParallel), where "
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
  const std::map<std::int64_t, double> scale_of = scales_before(run);  // for the true gradients' sizes
  struct PerModule {
    std::int64_t first = 0, harmful = 0;
    std::map<std::int64_t, std::int64_t> layers;  // layer id -> times first
    std::vector<std::int64_t> steps;
    std::vector<double> losses;      // the finite recorded losses of those steps
    double lowest_scale = INFINITY;  // the lowest loss scale it went NaN/Inf at
    double lowest_after = INFINITY;  // the lowest its skips left the scale at
    std::int64_t below_floor = 0;    // steps it was first in at a scale below the floor
    std::set<std::string> between;   // parameterless modules the gradient passed on its way
    // Modules given its output whose gradients were the last finite ones before its first
    // NaN/Inf: their backward ran just before it and sent it that gradient. Times each was.
    std::map<std::string, std::int64_t> after;
    std::map<std::string, std::vector<std::string>> through;  // the parameterless modules between it and each
    std::set<std::string> tied;      // its layers that another module holds too, first in its use
    std::set<std::string> ran_before;  // the modules whose gradient arrived just before its first NaN/Inf one
    bool chained = false;  // a block whose calls chain in each forward, named for a layer inside it
  };
  std::map<std::string, PerModule> modules;
  std::int64_t considered = 0;
  std::vector<std::int64_t> unordered;  // skipped steps whose first NaN/Inf gradient is unknown
  const bool half_loss = has_half_loss(run);
  const TiedUses tied = tied_uses(run);
  const InputsFrom given = inputs_from(run);
  const Fp32Gradients fp32 = fp32_gradients(run);
  const std::set<std::string>& pinned = fp32.pinned;
  const std::string whole = whole_model(run);
  const std::set<std::string> chained = chained_modules(run);
  // Skips below the floor that no layer's gradient was first in, by what they were: what
  // took the scale down where no module was ever first there.
  std::map<std::string, std::int64_t> others_below_floor;
  for (std::size_t i = 0; i < run.steps.size(); ++i) {
    const StepSummary& s = run.steps[i];
    if (!s.row.skipped) continue;
    const bool below = s.row.scale_before < t.scale_floor;
    if (forward_failed(run, s)) {
      if (below) ++others_below_floor["steps whose loss or forward went NaN/Inf"];
      continue;
    }
    if (half_loss && half_loss_skip(s)) {  // the loss's gradient overflowed: half-loss says so
      if (below) ++others_below_floor["steps whose float16 loss's gradient overflowed"];
      continue;
    }
    if (s.nonfinite_layers.empty() || !s.nonfinite_ordered) {
      if (below) ++others_below_floor["steps whose first NaN/Inf gradient is unknown"];
      if (!s.nonfinite_layers.empty()) unordered.push_back(s.row.step);
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
    // the innermost module holding both, unless that is only the model itself (or the
    // module holding every layer, DDP's "module").
    std::string module = use != tied.end() ? use->second : suggest::module_for_layer(run, layer);
    if (s.last_finite_before >= 0) {
      const std::string common =
          rundb::common_module(run.layers[std::size_t(s.last_finite_before)].info.module_path, layer.module_path);
      if (!common.empty() && common != whole) module = suggest::probed_module(run, common);
    }
    // Inside a block whose calls chain (ALBERT's shared layer), the parameters the calls share
    // get their gradient once every call's backward has run, so the first of them says only
    // that the block made it: in some call, somewhere inside.
    const std::string block = use == tied.end() ? chained_block(chained, layer.module_path) : std::string();
    const bool inside = !block.empty() && rundb::within(module, block);
    if (inside) module = block;
    PerModule& m = modules[module];
    if (inside && !m.chained) {
      m.chained = true;
      parameterless_inside(run, block, m.between);
    }
    ++m.first;
    m.harmful += harmful[i];
    ++m.layers[first_layer];
    if (layer.module_path != run.layers[std::size_t(first_layer)].info.module_path) m.tied.insert(layer.name);
    m.lowest_scale = std::min(m.lowest_scale, s.row.scale_before);
    m.lowest_after = std::min(m.lowest_after, s.row.scale_after);
    m.below_floor += s.row.scale_before < t.scale_floor;
    if (s.last_finite_before >= 0) {
      const rundb::LayerRow& last_finite = run.layers[std::size_t(s.last_finite_before)].info;
      parameterless_between(run, layer, last_finite, m.between);
      const std::string user = suggest::module_for_layer(run, last_finite);
      m.ran_before.insert(user);
      std::vector<std::string> through;
      if (takes_output_of(run, given, user, module, &through)) {
        ++m.after[user];
        m.through[user] = through;
      }
    }
    m.steps.push_back(s.row.step);
    if (run.loss_known(s.row) && std::isfinite(s.row.loss)) m.losses.push_back(s.row.loss);
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
  // What took the scale below the floor where no module went first there.
  const std::string took_it =
      ranked.empty() || ranked.front().second.below_floor > 0 ? "" : most_often(others_below_floor);
  bool top = true;
  for (const auto& [module, m] : ranked) {
    // Under a collapse, a module whose every skip calibrated the scale from above the floor
    // is not what took it below, where the top module went on overflowing: its pin would
    // not lift the scale (a box head first only at the initial 65536, while the backbone
    // it sends an Inf to held the scale at 16).
    // So is the top module where no module went first below the floor and other skips did
    // (a loss code's NaN in every step: a head first only at the initial scale).
    const PerModule& lowest = ranked.front().second;
    const bool only_above = collapsed && m.harmful == 0 && m.below_floor == 0 &&
                            (lowest.below_floor > 0 || !others_below_floor.empty());
    const bool harms = hurts && (collapsed || m.harmful > 0) && !only_above;
    const auto layer = std::max_element(m.layers.begin(), m.layers.end(),
                                        [](const auto& a, const auto& b) { return a.second < b.second; });
    const rundb::LayerRow& row = run.layers[std::size_t(layer->first)].info;
    std::string place = suggest::place_of(run, module, row);
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
    if (m.chained)
      f.evidence += "; " + module + " runs again and again in each forward, each call taking the last one's output: "
                    "the parameters its calls share receive their gradient once every call's backward has run, and a "
                    "NaN/Inf one call's backward makes reaches the calls before it, so which of them went NaN/Inf "
                    "first says neither which call made them nor where in it";
    if (only_above) {
      f.title = place + " went NaN/Inf first only at loss scales above the floor; " +
                (!took_it.empty()                 ? took_it
                 : ranked.front().first.empty() ? std::string("the model's overflows")
                                                : ranked.front().first + "'s overflows") +
                " took the scale below it";
      f.evidence += "; all at a loss scale of " + fmt(m.lowest_scale) + " or above, where they only calibrated the "
                    "scale or answered its growth probes: the skips that took it below the floor of " +
                    fmt(t.scale_floor) + " were " + (took_it.empty() ? std::string("other modules'") : took_it);
    } else if (!harms) {
      f.title = place + " is where the occasional overflow starts; the loss scale copes with it";
      f.evidence += m.harmful > 0 ? "; the scale stays above the floor and " + counted_skips(run) +
                                        " stay within the " + fmt(t.skip_rate * 100.0) + "% threshold"
                                  : "; the scale stays above the floor and these skips only calibrate it or answer "
                                    "its growth probes";
    }
    f.steps.assign(m.steps.begin(), m.steps.begin() + std::min<std::size_t>(m.steps.size(), 20));
    // At a scale of 1 or below the scaler no longer enlarges the gradients: going NaN/Inf
    // there takes a true gradient beyond fp16's range, or a NaN its backward makes in any
    // precision (sqrt or norm of 0), which pinning cannot help. Neither is ruled out.
    const bool at_any_scale = harms && run.has_scaler() && m.lowest_scale <= 1.0;
    // Where its finite steps show gradients beyond fp16's range unscaled, that is why.
    // So is a scale that settled below the floor, above 1, where they fit only there: the
    // gradients themselves are hundreds of times larger than a loss of order 1 makes (raw
    // 0..255 pixels as an autoencoder's targets: a loss around 6600, the scale down to 16).
    // Not where the gradient reaching its output was already NaN/Inf: then the code after it
    // (a gain) made them large in its fp16 backward, and the module's FP32 pin holds them.
    // Unless the loss's residuals make them (residuals_explain): the gradient it sends into the
    // module's output is then as large at any gain (PPO's value loss on returns of 500, around
    // 125000: its head went NaN/Inf down to a scale of 128).
    const OutputGradient reaching = output_gradient(run, module);
    const bool below_floor = harms && run.has_scaler() && !at_any_scale && m.lowest_after < t.scale_floor;
    const TrueGradient true_largest = (at_any_scale || below_floor) && run.fp16()
                                          ? largest_true_gradient_of(run, module, m.layers, scale_of, fp32)
                                          : TrueGradient{};
    std::vector<double> overflow_losses = m.losses;
    const double loss_size = overflow_losses.empty() ? NAN : median_of(overflow_losses);
    const bool loss_made = reaching.seen == "nonfinite" && true_largest.value > 0.0 &&
                           residuals_explain(loss_size, true_largest.value);
    const double true_max = at_any_scale || reaching.seen != "nonfinite" || loss_made ? true_largest.value : 0.0;
    const double limit = at_any_scale ? run.fp_max : run.fp_max / t.scale_floor;
    const bool too_large = true_max > limit;
    // Where the code after the module made them under a scale that collapsed below the floor,
    // other layers' own finite steps beyond 65504 / the floor hold it there whatever is done
    // around the module (a RealNVP flow on unnormalised data: its last coupling's scale net
    // pinned, the next coupling's gradients of up to 584 kept the scale at 64).
    const bool made_after = harms && collapsed && !at_any_scale && reaching.seen == "nonfinite" && !loss_made;
    const std::vector<std::pair<std::string, double>> others =
        too_large || made_after ? also_beyond(run, module, limit, scale_of, fp32)
                                : std::vector<std::pair<std::string, double>>{};
    if (too_large) {
      f.title = at_any_scale ? place + "'s gradients exceed fp16's range even unscaled (up to " + fmt(true_max) + ")"
                             : place + "'s gradients are too large for a loss scale above the floor of " +
                                   fmt(t.scale_floor) + " (up to " + fmt(true_max) + " unscaled)";
      const std::string of_layer = m.layers.count(true_largest.layer)
                                       ? std::string()
                                       : run.layers[std::size_t(true_largest.layer)].info.name + ", ";
      f.evidence += "; in the steps where they stayed finite the largest unscaled one was " + fmt(true_max) + " (" +
                    of_layer + "step " + std::to_string(true_largest.step) + ")" +
                    (at_any_scale ? ", above fp16's 65504: the scale has to stay below 1 to fit them "
                                    "(they overflowed down to " + fmt(m.lowest_scale) + "), which flushes the small ones "
                                    "to zero"
                                  : ", above 65504 / " + fmt(t.scale_floor) + ": the scale has to stay below the floor "
                                    "to fit them (they overflowed down to " + fmt(m.lowest_scale) + "), where small "
                                    "gradients flush to zero");
      if (loss_made)
        f.evidence += "; at step " + std::to_string(reaching.step) + " the gradient reaching " + module +
                      "'s output already held NaN/Inf: the loss's own, which a loss around " + fmt(loss_size) +
                      " makes about that large";
      // Without module rows the outputs are unknown (shrink_the_loss says so), while the
      // backward's order shows a layer far too large after it (a LibTorch classifier's head
      // 17000 times too large, its cross-entropy 10760): its gain makes them that large.
      if (run.modules.empty())
        if (auto fix = reinitialise_after(run, module, modules_after(run, m.layers, m.ran_before)))
          f.suggestions.push_back(*fix);
      shrink_the_loss(run, m.losses, m.steps, true_max, true_max / limit, f);
    }
    // A norm that made all zeros says why without a finite step to measure them in (BLIP-2's
    // Q-Former over query tokens of zeros, layer_norm_eps 1e-12: every step skipped to 1).
    const FlatNorm flat = flat_normalisation_after(run, module);
    const bool flat_shown = flat.norm != nullptr && (too_large || flat.norm->zero_step >= 0);
    if (flat_shown) f.evidence += flat_norm_evidence(flat, module);
    const BackwardReplay replay = at_any_scale && !too_large ? backward_replay(run, module) : BackwardReplay{};
    // A replay that ran on a finite output gradient already says where they were made.
    const OutputGradient entry =
        (replay.outcome.empty() || replay.outcome == "unconfirmed") && !(too_large && loss_made) ? reaching
                                                                                                : OutputGradient{};
    const bool entered = entry.seen == "nonfinite";
    const GradientSenders senders = entered ? gradient_senders(run, module) : GradientSenders{};
    const bool sent = !senders.paths.empty();
    bool sender_code_given = false;  // the look at a sender's code that holds no parameters
    // torch's Linear turning a finite gradient at its output into Inf at a scale of 1 took a
    // true gradient beyond the range: nothing in its backward makes NaN from finite values (a
    // Poisson regression diverging on counts around 2000, its loss up to 61495).
    const std::string products = at_any_scale && !too_large && reaching.seen == "finite" && m.between.empty() &&
                                         replay.outcome != "finite" && replay.outcome != "intrinsic"
                                     ? products_only_type(run, module)
                                     : std::string();
    if (!products.empty()) {
      f.title = place + "'s gradients exceed fp16's range even unscaled: they went NaN/Inf first down to a loss scale "
                "of " + fmt(m.lowest_scale);
      f.evidence += "; down to a loss scale of " + fmt(m.lowest_scale) + ", which no longer enlarges the gradients: " +
                    module + " is torch's " + products + ", whose backward only multiplies and adds, so from the "
                    "finite gradient reaching its output it made Inf only where its true gradients passed 65504";
      shrink_the_loss(run, m.losses, m.steps, run.fp_max, 1.0, f);
    } else if (at_any_scale && !too_large) {
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
      // The modules that sent the NaN/Inf back to it made them: their backward first.
      std::string suspects, between;
      for (const auto& path : senders.paths) suspects += path + ", ";
      for (const auto& path : m.between) {
        between += path + ", ";
        if (std::find(senders.paths.begin(), senders.paths.end(), path) == senders.paths.end()) suspects += path + ", ";
      }
      if (!m.between.empty())
        f.evidence += "; between its gradient and the last finite one, the backward also ran through " +
                      between.substr(0, between.size() - 2) +
                      (m.between.size() == 1 ? ", which holds no parameters" : ", which hold no parameters");
      suspects += module.empty() ? std::string("the code that uses ") + row.name : module;
      if (replay.outcome != "finite") f.suggestions.push_back(suggest::singular_backward(suspects));
      // The modules without parameters it passed get no replay of their own; the other kind
      // of NaN, an fp16 value inside their backward beyond 65504, is theirs to pin (a custom
      // activation whose backward takes exp() of its fp16 input: pinned, it trains).
      if (replay.outcome != "finite" && replay.outcome != "intrinsic" && !m.between.empty())
        pin_parameterless(run, m.between, f);
    }
    const std::string code_after = sent ? senders.paths.front() + "'s backward" : "the code that uses " + module + "'s output";
    const auto most = std::max_element(m.after.begin(), m.after.end(),
                                       [](const auto& a, const auto& b) { return a.second < b.second; });
    const std::string user = sent ? senders.paths.front() : most == m.after.end() ? std::string() : most->first;
    if (entered) {
      if (harms && !at_any_scale)
        f.title = place + " holds the first NaN/Inf gradients, but they reach it through its output: " + code_after +
                  " makes them";
      f.evidence += "; at step " + std::to_string(entry.step) + " the gradient reaching " + module +
                    "'s output already held NaN/Inf, so its own backward received them" + (sent ? "; " : ": ");
      if (sent) {
        std::string others, via;
        for (std::size_t k = 1; k < senders.paths.size(); ++k) others += (k > 1 ? ", " : "") + senders.paths[k];
        const auto through = m.through.find(user);
        if (others.empty() && through != m.through.end())
          for (const auto& path : through->second) via += (via.empty() ? " through " : " and ") + path;
        f.evidence += "at step " + std::to_string(senders.step) + " " + user +
                      (others.empty() ? std::string() : " (then " + others + ")") +
                      ", given " + module + "'s output" + via + ", received a finite gradient at its own output and sent NaN/Inf "
                      "back to it: " + (others.empty() ? "its" : "their") + " backward made them" +
                      (at_any_scale ? std::string()
                                    : " in fp16, where a factor such as large weights, a gain or an exp() enlarges "
                                      "the gradient sent back");
      } else {
        std::string where, via;
        const std::vector<std::string> none;
        const std::vector<std::string>& through = user.empty() ? none : m.through.at(user);
        for (const auto& path : through) via += (via.empty() ? " through " : " and ") + path;
        if (!user.empty())
          where = user + ", which is given " + module + "'s output" + via + " and whose backward ran just before " +
                  module + "'s, its own gradients finite; ";
        for (const auto& path : m.between)
          if (std::find(through.begin(), through.end(), path) == through.end()) where += path + ", ";
        f.evidence += code_after + " (" + where + code_after_place(run, module) + ") made them" +
                      (at_any_scale ? std::string()
                                    : " in its fp16 backward, where a factor such as a gain, a temperature or an exp() "
                                      "enlarges the gradient it sends back");
        if (user.empty()) f.evidence += code_after_evidence(run, module);
      }
      if (harms) f.blame = code_after;  // what the symptoms' fixes point to
    } else if (entry.seen == "finite") {
      f.evidence += "; at step " + std::to_string(entry.step) + " the gradient reaching its output was finite: its own "
                    "backward made them";
    }
    if (harms && replay.outcome != "intrinsic") {  // nothing to fix when the scaler copes
      // Made after the module at every scale: its pin cannot help (the look at the backward above stays).
      const bool was_pinned = pinned.count(module) > 0;
      if (was_pinned)
        f.evidence += "; " + module + " already ran in FP32 (pinned), so pinning it is no fix";
      if (entered && !at_any_scale && !was_pinned && !others.empty()) {
        // What enlarges the gradient itself is still the fix (a temperature's bound, a constant
        // lowered, a sender's weights re-initialised); the module's pin and that code in FP32
        // leave the other layers' gradients as large (CLIP's towers at logit_scale 11.5 with
        // the similarities computed in FP32: the scale still down to 8).
        if (!sent && user.empty()) {
          if (auto bound = bound_exp_parameter(run, module)) f.suggestions.push_back(*bound);
          if (auto lower = lower_constant(run, module)) f.suggestions.push_back(*lower);
        }
        for (const std::string& sender : sent ? senders.paths : std::vector<std::string>{})
          if (auto fix = reinitialise_sender(run, sender, module)) f.suggestions.push_back(*fix);
        pin_beyond_others(run, module, row.name, others, false, t.scale_floor, f);
      } else if (entered && !at_any_scale) {
        // The gradient that code sends back is beyond fp16 all the way into the module: the
        // pin keeps it float32 there (and the code after it up to the next operation that
        // autocast runs in fp16), autocast off around the code keeps that operation's too.
        // A module after it sends that gradient from a backward that autocast runs in fp16
        // whatever its input's dtype: the module pinned alone still receives it overflowed.
        const std::size_t before_pins = f.suggestions.size();
        if (was_pinned) {
          // Pinned, it still receives them: only the module that sends them, if any, and the
          // code after it are left to run in FP32.
          if (!user.empty() && !pinned.count(user)) {
            const std::optional<Suggestion> reinit = reinitialise_sender(run, user, module);
            if (reinit) f.suggestions.push_back(*reinit);
            f.suggestions.push_back(suggest::pin_fp32(run, user));
            f.suggestions.back().summary = "Run " + user + " in FP32 too: " + module + " is pinned and still receives "
                                           "the overflowed gradient from " + user + "'s backward, which autocast runs "
                                           "in fp16.";
            if (reinit) by_design(f.suggestions.back());
          }
        } else if (!user.empty()) {
          const std::vector<std::string> more =
              sent ? std::vector<std::string>(senders.paths.begin() + 1, senders.paths.end()) : std::vector<std::string>{};
          // A sender whose weights start far too large multiplies the gradient by that gain
          // in its backward: that is the cause, and its pin only moves the overflow into the
          // layers before it where they take that gradient in fp16 too (an LM head 7000 times
          // too large over a decoder: pinned with the final norm, the scale still collapses).
          // The pin stays, for a gain by design.
          bool reinitialised = false;
          for (const std::string& sender : sent ? senders.paths : std::vector<std::string>{user})
            if (auto fix = reinitialise_sender(run, sender, module)) {
              f.suggestions.push_back(*fix);
              reinitialised = true;
            } else if (auto code = sent ? sender_code_fix(run, sender, module) : std::nullopt) {
              f.suggestions.push_back(*code);
              reinitialised = sender_code_given = true;
            }
          f.suggestions.push_back(suggest::pin_fp32_both(
              run, module, user,
              "(pinned: " + module + "'s output and the gradient it receives become float32, and so does " + user +
                  "'s backward, which sends that gradient), so that it stays in FP32 from " + user + " into " + module +
                  ": pinned alone, " + module + " would still receive it from " + user + "'s backward, which autocast "
                  "runs in fp16.",
              more));
          if (reinitialised) by_design(f.suggestions.back());
        }
        const bool after_a_pin = f.suggestions.size() > before_pins;
        for (std::size_t k = 1; after_a_pin && k < senders.paths.size(); ++k)
          f.suggestions.back().summary += " " + senders.paths[k] + " sent them too: it is pinned with them.";
        if (!sent && user.empty()) {
          // That code passed the gradient back through a layer after the module whose weights
          // start far too large (LFM2's tied LM head 3e4 times too large: the gradient reaching
          // a feed-forward's output overflowed): its gain is the cause, and the pins are for a
          // gain by design.
          const std::optional<Suggestion> reinit =
              was_pinned ? std::nullopt : reinitialise_after(run, module, modules_after(run, m.layers, m.ran_before));
          if (reinit) f.suggestions.push_back(*reinit);
          if (auto bound = bound_exp_parameter(run, module)) f.suggestions.push_back(*bound);
          const std::size_t pin_at = f.suggestions.size();
          for (Suggestion& fix : code_after_fixes(run, module, code_after, was_pinned))
            f.suggestions.push_back(std::move(fix));
          if (reinit && pin_at < f.suggestions.size() && f.suggestions[pin_at].summary.rfind("Run ", 0) == 0)
            by_design(f.suggestions[pin_at]);
        } else if (!sent) {  // a module that sent them is the code after it, and its pin covers that code
          f.suggestions.push_back(suggest::fp32_model_code(run, "that uses " + module + "'s output", ""));
          std::string& also = f.suggestions.back().summary;
          also[0] = 'r';  // "Run ..." continues the sentence
          also = "Where that code runs a matmul or another operation that autocast puts in fp16 whatever its inputs, " +
                 std::string(after_a_pin ? "also " : "") + also;
        }
      } else if (!entered && !was_pinned && !others.empty()) {
        pin_beyond_others(run, module, row.name, others, at_any_scale, t.scale_floor, f);
      } else if (!entered && !was_pinned) {
        // Its own backward overflowed, on gradients that passed back through a layer whose
        // weights start far too large, at or after it in forward: they are that many times
        // too large in every layer before it, and pins only move the overflow from one to the
        // next (an LM head 12000 times too large: the two down projections pinned, the
        // attention output's overflow is next). The pins stay, for a gain by design.
        const std::size_t before_fixes = f.suggestions.size();
        // At every scale, unless its replay was finite in FP32 or it is one of torch's modules
        // whose backward only multiplies and adds (`products`), a function whose gradient is
        // infinite somewhere (sqrt of 0) may make the NaN at any gain: the look at its backward
        // above leads, unless the oversized layer is inside the module and its finite steps'
        // true gradients reached a tenth of the range (an ODE's function whose output layer
        // starts 3000 times too large, its gradients up to 23392 unscaled).
        const bool unproven = at_any_scale && !too_large && products.empty() && replay.outcome != "finite";
        bool inside = false;
        std::optional<Suggestion> reinit =
            too_large ? std::nullopt : reinitialise_after(run, module, modules_after(run, m.layers, m.ran_before), &inside);
        const bool gain_leads = reinit && unproven && inside && true_largest.value >= run.fp_max / 10.0 &&
                                lead_the_look(*reinit, true_largest.value, run.fp_max, f);
        if (reinit && unproven && !gain_leads) {
          reinit->summary[0] = char(std::tolower(static_cast<unsigned char>(reinit->summary[0])));
          reinit->summary = "If instead its true gradients are the ones beyond fp16: " + reinit->summary;
        }
        if (reinit && !gain_leads) f.suggestions.push_back(*reinit);
        if (!pin_with_own_overflows(run, module, place, m.steps, !too_large && !at_any_scale, f)) {
          f.suggestions.push_back(suggest::fp32_at(run, module, row));
          if (unproven && !reinit)
            f.suggestions.back().summary = "If its true gradients are the ones beyond fp16: " + f.suggestions.back().summary;
        }
        if (reinit) by_design(f.suggestions[before_fixes + 1]);
      }
      f.suggestions.push_back(suggest::use_bf16(run));
      if (f.suggestions.size() == 1) {  // no other way is left: not an "Or"
        std::string& only = f.suggestions.back().summary;
        if (only.rfind("Or t", 0) == 0) only = "T" + only.substr(4);
      }
    }
    // A sender without parameters enlarged the gradient in its own code, whatever the scale
    // and the loss: that code leads every other fix (a gradient reversal's lambda of 1e5).
    // Not where the NaN/Inf came at every scale while the finite steps' gradients fit: a
    // function whose gradient is infinite somewhere (sqrt of 0), which the look above names.
    if (harms && sent && !sender_code_given && (too_large || !at_any_scale))
      if (auto code = sender_code_fix(run, senders.paths.front(), module))
        f.suggestions.insert(f.suggestions.begin(), *code);
    if (harms && flat_shown)
      if (auto spread = spread_zero_inputs(run, *flat.norm)) f.suggestions.insert(f.suggestions.begin(), *spread);
    out.push_back(f);
    top = top && !harms;
  }
  if (considered == 0 && !unordered.empty()) out.push_back(unordered_overflow(run, unordered, hurts));
}

}  // namespace ampdiag::analyzer::rules
