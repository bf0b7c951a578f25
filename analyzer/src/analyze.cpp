// analyze(): runs every rule on every rank, merges what the ranks agree on, ranks the
// findings and explains every skipped step.
#include "ampdiag/analyzer/analyze.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "ampdiag/analyzer/causes.h"
#include "ampdiag/rundb/rows.h"
#include "device_profile.h"
#include "rules.h"

namespace ampdiag::analyzer {

const char* severity_name(Severity s) {
  switch (s) {
    case Severity::kInfo: return "info";
    case Severity::kWarning: return "warning";
    case Severity::kError: return "error";
  }
  return "unknown";
}

bool Report::healthy() const {
  for (const auto& f : findings)
    if (f.severity != Severity::kInfo) return false;
  return true;
}

const std::vector<std::string>& rule_ids() {
  static const std::vector<std::string> ids = {"scale-collapse", "overflow-origin",   "forward-nonfinite", "low-headroom",
                                               "underflow",      "skip-rate",         "rank-disagreement", "missing-ranks",
                                               "autopin",        "stalled-updates",   "half-parameters",
                                               "half-loss",      "input-nan",         "nonfinite-update",
                                               "nonfinite-parameters", "loss-backward",
                                               "optimizer-outside-scaler", "loss-divergence",
                                               "clip-before-unscale", "unscaled-backward",
                                               "gradients-not-zeroed", "gradients-cleared", "zero-gradients", "fused-sgd-momentum",
                                               "accumulated-gradients-cleared", "precision-loss",
                                               "weight-growth", "oversized-weights", "training-raised", "evaluation-overflow",
                                               "scale-held", "unreached-layers", "dead-layers", "flushed-weights",
                                               "per-sample-gradients"};
  return ids;
}

void check_one_run(const std::vector<Run>& runs) {
  if (runs.size() < 2) return;
  std::map<std::int64_t, const Run*> by_rank;
  for (const auto& run : runs) {
    const auto [it, fresh] = by_rank.emplace(run.rank, &run);
    if (!fresh)
      throw rundb::RunDbError(it->second->path == run.path
                                  ? run.path + " is given twice: give each rank's run.db once"
                                  : run.path + " and " + it->second->path + " are both rank " + std::to_string(run.rank) +
                                        ": give one run.db per rank of one run");
    const Run& first = runs.front();
    if (run.run_id != first.run_id || run.world_size != first.world_size)
      throw rundb::RunDbError(run.path + " is not from the same run as " + first.path + " (" +
                              (run.run_id != first.run_id ? "run id " + (run.run_id.empty() ? "none" : run.run_id) +
                                                                " vs " + (first.run_id.empty() ? "none" : first.run_id)
                                                          : "world size " + std::to_string(run.world_size) + " vs " +
                                                                std::to_string(first.world_size)) +
                              "): report on each run separately, or compare them with ampdiag diff");
  }
}

namespace {

// The findings must agree: a fix that cannot work while another finding holds is
// replaced by the one that can, and a symptom names its cause.
void make_consistent(Report& report) {
  // torch.amp.GradScaler refuses fp16 parameters' gradients: with fp16 parameters a scaler
  // comes with FP32 master weights, which the stalled-updates fix already says.
  const bool half_parameters = std::any_of(report.findings.begin(), report.findings.end(), [](const Finding& f) {
    return f.rule == "stalled-updates" || f.rule == "half-parameters";
  });
  for (auto& f : report.findings)
    if (f.rule == "underflow" && half_parameters)
      f.suggestions = {{"Keep FP32 master weights and add a loss scaler: train the float32 model under fp16 "
                        "autocast with torch.amp.GradScaler (it refuses gradients of fp16 parameters), which lifts "
                        "these gradients into fp16's range.",
                        "", ""}};
  // The NaN/Inf an optimizer stepping outside scaler.step() applied is that step's doing.
  const bool outside_scaler = std::any_of(report.findings.begin(), report.findings.end(), [](const Finding& f) {
    return f.rule == "optimizer-outside-scaler" && f.severity == Severity::kError;
  });
  for (auto& f : report.findings)
    if (f.rule == "nonfinite-update" && outside_scaler)
      f.suggestions = {{"Step the optimizer through the scaler (see optimizer-outside-scaler): it skips a step whose "
                        "gradients hold NaN/Inf.",
                        "", ""}};
  // Gradients clipped while scaled are as small at any scale: no scale lifts them.
  // So are gradients of a backward that never started from the scaled loss.
  const auto unscaled = std::find_if(report.findings.begin(), report.findings.end(), [](const Finding& f) {
    return f.rule == "clip-before-unscale" || f.rule == "unscaled-backward";
  });
  for (auto& f : report.findings)
    if (f.rule == "underflow" && unscaled != report.findings.end())
      f.suggestions = {{unscaled->rule == "clip-before-unscale"
                            ? "Unscale before clipping (see clip-before-unscale): clipped while multiplied by the "
                              "scale, these gradients are cut to the same small norm at any loss scale."
                            : "Call backward() on scaler.scale(loss) (see unscaled-backward): these gradients never "
                              "held the scale, so no scale setting lifts them.",
                        "", ""}};
  // NaN/Inf in the parameters makes every step on them NaN/Inf: the scaler skips them all,
  // and its symptoms from then on are theirs, not an overflow's.
  // So does a loss whose backward makes NaN/Inf: no scale avoids it.
  const auto damage = std::find_if(report.findings.begin(), report.findings.end(), [](const Finding& f) {
    return f.rule == "nonfinite-parameters" || f.rule == "nonfinite-update" ||
           (f.rule == "loss-backward" && f.severity == Severity::kError);
  });
  if (damage != report.findings.end() && !damage->steps.empty()) {
    const std::string cause =
        damage->rule == "nonfinite-parameters"
            ? (rules::ends_with(damage->title, "code outside the optimizer wrote them")
                   ? "the NaN/Inf written into the parameters by step " + std::to_string(damage->steps.front())
                   : std::string("the NaN/Inf the parameters held from the start"))
        : damage->rule == "loss-backward"
            ? "the NaN/Inf the loss's backward makes"
            : "the NaN/Inf that step " + std::to_string(damage->steps.front()) + "'s update wrote into the parameters";
    const std::string why = damage->rule == "loss-backward"
                                ? "): every step it happens in is skipped, at any scale; the scale recovers once it is gone."
                                : "): every step that runs on them goes NaN/Inf and is skipped; the scale recovers once "
                                  "they are finite.";
    for (auto& f : report.findings)
      if ((f.rule == "scale-collapse" || f.rule == "skip-rate") && (f.steps.empty() || f.steps.front() >= damage->steps.front()))
        f.suggestions = {{outside_scaler && damage->rule == "nonfinite-update"
                              ? "Step the optimizer through the scaler (see optimizer-outside-scaler): the NaN/Inf "
                                "it applied makes every step after it NaN/Inf, which the scaler skips."
                              : "Fix " + cause + " (see " + damage->rule + why,
                          "", ""}};
  }
  const Finding* culprit = nullptr;
  for (const auto& f : report.findings)
    if ((f.rule == "overflow-origin" || f.rule == "forward-nonfinite") && f.severity != Severity::kInfo &&
        (!f.module.empty() || f.rule == "forward-nonfinite")) {
      culprit = &f;
      break;
    }
  if (!culprit) {
    // Only the data made the forward NaN/Inf: the collapse is its doing.
    const auto input = std::find_if(report.findings.begin(), report.findings.end(), [](const Finding& f) {
      return f.rule == "input-nan" && !f.blame.empty();
    });
    if (input == report.findings.end()) return;
    for (auto& f : report.findings)
      if (f.rule == "scale-collapse" && !f.suggestions.empty() && f.suggestions.front().python.empty() &&
          f.suggestions.front().summary.rfind("Fix what overflows", 0) == 0)
        f.suggestions.front().summary = "Fix " + input->blame + " (see input-nan); the scale recovers once it is gone.";
    return;
  }
  // (An overflow-origin's blame is the code after its module, which made what reached it.)
  const std::string name = culprit->rule == "overflow-origin" && !culprit->blame.empty() ? culprit->blame
                           : !culprit->module.empty()           ? culprit->module
                           : !culprit->blame.empty()            ? culprit->blame
                           : culprit->rule == "overflow-origin" ? "the gradient of " + culprit->layer
                                                                : "the model's own forward()";
  for (auto& f : report.findings) {
    if (&f == culprit) continue;
    if (f.rule == "scale-collapse" && !f.suggestions.empty() && f.suggestions.front().python.empty() &&
        f.suggestions.front().summary.rfind("Fix what overflows", 0) == 0) {
      f.suggestions.front().summary =
          culprit->blame.empty()
              ? "Fix the overflow in " + name + " (see " + culprit->rule + "); the scale recovers once nothing overflows."
              : "Fix the NaN/Inf made in " + name + " (see " + culprit->rule +
                    "); the scale recovers once it is gone.";
    } else if (f.rule == "underflow") {
      f.suggestions.clear();
      f.suggestions.push_back({"Fix the overflow in " + name + " first (see " + culprit->rule +
                                   "): it holds the loss scale down; once it no longer overflows the scale grows and "
                                   "lifts these gradients back into fp16's range.",
                               "", ""});
    }
  }
}

void missing_ranks(const std::vector<Run>& runs, std::vector<Finding>& out) {
  const std::int64_t world = runs.front().world_size;
  if (world <= 1 || std::int64_t(runs.size()) >= world) return;
  std::vector<bool> have(std::size_t(world), false);
  for (const auto& r : runs)
    if (r.rank >= 0 && r.rank < world) have[std::size_t(r.rank)] = true;
  std::string missing;
  std::int64_t n = 0;
  for (std::int64_t r = 0; r < world; ++r)
    if (!have[std::size_t(r)]) {
      if (n < 8) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      ++n;
    }
  Finding f;
  f.rule = "missing-ranks";
  f.severity = Severity::kWarning;
  f.score = 20.0;
  f.title = "The run had " + std::to_string(world) + " ranks; " + rules::plural(n, "rank") + " not given";
  f.evidence = "missing rank(s): " + missing + (n > 8 ? ", ..." : "") +
               "; this report covers only the ranks given, so a layer that overflows only there is not seen";
  f.suggestions.push_back({"Give every rank's run.db: ampdiag report " + runs.front().path.substr(0, runs.front().path.rfind(".rank")) +
                               ".rank*.db",
                           "", ""});
  out.push_back(f);
}

// Whether any layer has a gradient row at `step` (samples are in step order).
bool gradients_recorded(const Run& run, std::int64_t step) {
  for (const auto& layer : run.layers) {
    const auto it = std::lower_bound(layer.samples.begin(), layer.samples.end(), step,
                                     [](const GradSample& g, std::int64_t s) { return g.step < s; });
    if (it != layer.samples.end() && it->step == step) return true;
  }
  return false;
}

// A rank whose own gradients were finite in a skipped step is told which rank's were not at
// that step, where one's were (FSDP's ShardedGradScaler reduces found_inf across ranks).
void name_other_ranks(std::vector<SkippedStep>& skipped) {
  std::map<std::int64_t, const SkippedStep*> nonfinite_at;
  for (const auto& k : skipped)
    if (!k.nonfinite_layers.empty()) nonfinite_at.emplace(k.step, &k);
  for (auto& k : skipped) {
    if (!k.nonfinite_layers.empty() || !k.gradients_recorded) continue;
    const auto it = nonfinite_at.find(k.step);
    if (it == nonfinite_at.end() || it->second->rank == k.rank) continue;
    k.nonfinite_rank = it->second->rank;
    k.nonfinite_rank_layer = it->second->nonfinite_layers.front();
  }
}

}  // namespace

Report analyze(const std::vector<Run>& runs, const Thresholds& t) {
  Report report;
  std::vector<Finding> all;
  for (const auto& run : runs) {
    std::vector<Finding> found;
    rules::scale_collapse(run, t, found);
    rules::overflow_origin(run, t, found);
    rules::forward_nonfinite(run, t, found);
    rules::underflow(run, t, found);
    rules::low_headroom(run, t, found);  // after underflow: it reads whether a layer underflows
    rules::skip_rate(run, t, found);
    rules::autopin(run, found);
    rules::half_parameters(run, t, found);
    rules::half_loss(run, found);
    rules::loss_backward(run, found);
    rules::nonfinite_update(run, found);
    rules::per_sample_gradients(run, found);
    rules::optimizer_outside_scaler(run, found);
    const std::map<std::int64_t, rules::StepGradients> by_step = rules::gradients_by_step(run);
    rules::clip_before_unscale(run, by_step, found);
    rules::unscaled_backward(run, found);
    rules::training_raised(run, found);
    rules::evaluation_overflow(run, found);
    rules::loss_divergence(run, found);
    rules::weight_growth(run, t, found);
    rules::fused_sgd_momentum(run, found);
    rules::precision_loss(run, t, found);  // before oversized_weights: a norm losing its outputs to fp16
    rules::oversized_weights(run, found);
    rules::gradients_not_zeroed(run, found);  // after the findings it explains
    rules::scale_held(run, t, found);            // so too
    rules::gradients_cleared(run, by_step, found);
    rules::accumulated_gradients_cleared(run, found);
    rules::flushed_weights(run, t, found);
    rules::unreached_layers(run, found);
    rules::dead_layers(run, found);
    rules::group_underflows(found);
    rules::group_calibration_overflows(found);
    for (auto& f : found) {
      f.ranks = {run.rank};
      all.push_back(std::move(f));
    }

    RunOverview o;
    o.path = run.path;
    o.rank = run.rank;
    o.steps = std::int64_t(run.steps.size());
    o.calibration_skips = rules::calibration_skips(run);
    o.first_scale = run.steps.front().row.scale_before;
    o.last_scale = run.steps.back().row.scale_after;
    o.min_scale = INFINITY;
    for (const auto& s : run.steps) {
      o.skipped += s.row.skipped;
      o.min_scale = std::min(o.min_scale, s.row.scale_after);
      if (!s.row.skipped) continue;
      SkippedStep k;
      k.rank = run.rank;
      k.step = s.row.step;
      k.scale = s.row.scale_before;
      k.loss = s.row.loss;
      k.nonfinite_layer_count = std::int64_t(s.nonfinite_layers.size());
      k.nonfinite_ordered = s.nonfinite_ordered;
      if (s.nonfinite_layers.empty()) k.gradients_recorded = gradients_recorded(run, s.row.step);
      for (std::size_t i = 0; i < s.nonfinite_layers.size() && i < 5; ++i)
        k.nonfinite_layers.push_back(run.layers[std::size_t(s.nonfinite_layers[i])].info.name);
      const StepCause cause = step_cause(run, s);
      k.forward = cause.forward;
      k.forward_module = cause.forward_module;
      report.skipped.push_back(k);
    }
    o.layers = std::int64_t(run.layers.size());
    o.modules = std::int64_t(run.modules.size());
    o.grad_rows = run.grad_rows;
    o.act_rows = run.act_rows;
    o.finished = run.finished;
    o.write_error = run.meta_or("write_error", "");
    o.lost_records = std::atoll(run.meta_or("lost_records", "0").c_str());
    o.dropped_steps = std::atoll(run.meta_or("dropped_steps", "0").c_str());
    o.dropped_records = std::atoll(run.meta_or("dropped_records", "0").c_str());
    for (const auto& e : run.events)  // "2 forwards whose output went NaN/Inf ..."
      if (e.kind == "forward-dropped") o.dropped_batches += std::max<std::int64_t>(1, std::atoll(e.detail.c_str()));
    o.amp_dtype = run.meta_or("amp_dtype", "float16");
    o.has_scaler = run.has_scaler();
    o.world_size = run.world_size;
    o.run_id = run.run_id;
    o.harmful_skips = rules::harmful_skips(run);
    o.skip_rate = rules::harmful_skip_rate(run);
    o.device = run.meta_or("device", "");
    o.device_profile = device_profile(run);
    report.runs.push_back(o);
  }
  name_other_ranks(report.skipped);
  rules::rank_disagreement(runs, t, all);
  if (!runs.empty()) missing_ranks(runs, all);

  // The same finding on several ranks is one finding seen on those ranks.
  std::map<std::string, std::size_t> seen;
  for (auto& f : all) {
    const std::string key = f.rule + "|" + f.module + "|" + f.layer + "|" + f.title;
    const auto it = seen.find(f.rule == "rank-disagreement" ? key + std::to_string(f.ranks.front()) : key);
    if (it == seen.end()) {
      seen[f.rule == "rank-disagreement" ? key + std::to_string(f.ranks.front()) : key] = report.findings.size();
      report.findings.push_back(std::move(f));
    } else {
      Finding& kept = report.findings[it->second];
      kept.ranks.insert(kept.ranks.end(), f.ranks.begin(), f.ranks.end());
      kept.score = std::max(kept.score, f.score);
    }
  }
  // Culprits (findings that name a module or layer) before symptoms of the same severity.
  std::stable_sort(report.findings.begin(), report.findings.end(), [](const Finding& a, const Finding& b) {
    if (a.severity != b.severity) return a.severity > b.severity;
    const bool a_names = !a.module.empty() || !a.layer.empty(), b_names = !b.module.empty() || !b.layer.empty();
    if (a_names != b_names) return a_names;
    return a.score > b.score;
  });
  make_consistent(report);
  return report;
}

}  // namespace ampdiag::analyzer
