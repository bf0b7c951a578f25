// forward_cause and step_cause; see causes.h.
#include "ampdiag/analyzer/causes.h"

#include <cmath>

#include "ampdiag/rundb/module_paths.h"

namespace ampdiag::analyzer {

namespace {

// The nearest enclosing module the agent replayed, or the nearest probed one when none
// was replayed (the one whose own code the NaN/Inf must come from), or "" (the model).
const rundb::ReplayRow* enclosing_replay(const Run& run, const std::string& path, std::string& probed) {
  probed.clear();
  for (std::string p = rundb::parent_of(path); !p.empty(); p = rundb::parent_of(p)) {
    if (const rundb::ReplayRow* r = run.replay_of(p)) return r;
    if (probed.empty() && run.module_named(p)) probed = p;
  }
  return nullptr;
}

}  // namespace

ForwardCause forward_cause(const Run& run, const std::string& first_seen) {
  ForwardCause c;
  c.first_seen = first_seen;
  c.module = first_seen;
  const rundb::ReplayRow* r = run.replay_of(first_seen);
  if (!r) return c;
  std::string path = first_seen;
  for (;;) {
    if (r->outcome == "finite") {
      c.module = path;
      c.confirmation = "confirmed";
      c.own_code = path != first_seen;
      c.fp32_absmax = r->fp32_absmax;
      return c;
    }
    if (r->outcome == "intrinsic") {
      c.module = path;
      c.confirmation = "unconfirmed";
      c.intrinsic = true;
      c.own_code = path != first_seen;
      c.reason = (path.empty() ? std::string("the model's own forward()") : path) +
                 " makes NaN/Inf from finite inputs in FP32 too, " +
                 (buffers_went_inf(replayed_buffers(run, path)) ? "from the Inf that training wrote into its buffers"
                                                                 : "so fp16's range is not the cause");
      return c;
    }
    if (r->outcome != "nonfinite") {  // unconfirmed: evidence of nothing, never escalated past
      c.module = path;
      c.confirmation = "unconfirmed";
      c.reason = r->reason;
      c.own_code = path != first_seen;
      return c;
    }
    c.disproved.push_back(path);
    std::string probed;
    const rundb::ReplayRow* up = enclosing_replay(run, path, probed);
    if (!up) {
      // Still NaN/Inf in FP32, and no enclosing module was replayed: the NaN/Inf reaches
      // `path` from the code that calls it.
      c.module = probed;
      c.confirmation = "unconfirmed";
      c.own_code = true;
      c.reason = path + " was still NaN/Inf in FP32, so it receives NaN/Inf from the code that calls it; " +
                 (probed.empty() ? std::string("the model's own forward() was not replayed")
                                 : probed + " was not replayed (its output was finite, or the run ended first)");
      return c;
    }
    path = up->module;
    r = up;
  }
}

std::string replayed_buffers(const Run& run, const std::string& path) {
  return run.module_event("buffers-nan", path).second;
}

bool buffers_went_inf(const std::string& buffers) { return buffers.find(" Inf") != std::string::npos; }

const ModuleSummary* overflow_after_intrinsic(const Run& run, const std::string& intrinsic) {
  const ModuleSummary* found = nullptr;
  for (const auto& m : run.modules) {
    const std::string& path = m.info.path;
    const bool inside = !intrinsic.empty() && path.size() > intrinsic.size() && path.rfind(intrinsic + ".", 0) == 0;
    if (path == intrinsic || inside || !run.finishes_at_or_after(path, intrinsic)) continue;
    const rundb::ReplayRow* r = run.replay_of(path);
    if (r && r->outcome == "finite" && m.nonfinite_steps > 0 && (!found || m.nonfinite_steps > found->nonfinite_steps))
      found = &m;
  }
  return found;
}

StepCause step_cause(const Run& run, const StepSummary& step) {
  StepCause c;
  if (after_nonfinite_update(run, step)) {
    c.forward = ForwardSource::kUpdate;
  } else if (step.first_nonfinite_module >= 0 && run.input_nan(step.row.step)) {
    c.forward = ForwardSource::kInput;
  } else if (nonfinite_from_module(run, step)) {
    const ForwardCause cause = forward_cause(run, run.modules[std::size_t(step.first_nonfinite_module)].info.path);
    // A module that makes NaN/Inf by design (a -inf mask) matters where the loss went
    // NaN/Inf; an unknown loss (none recorded) is not a NaN one.
    if (!(cause.intrinsic && !run.loss_nonfinite(step.row))) {
      c.forward = ForwardSource::kModule;
      c.forward_module = cause.module;
      if (cause.intrinsic)
        if (const ModuleSummary* m = overflow_after_intrinsic(run, cause.module)) c.forward_module = m->info.path;
    }
  } else if (!run.modules.empty() && run.loss_nonfinite(step.row)) {
    c.forward = ForwardSource::kLoss;
  }
  if (c.forward == ForwardSource::kNone &&
      (run.output_gradient_nonfinite(step.row.step) || run.output_overflow_in_loss(step.row.step)))
    c.forward = ForwardSource::kLossBackward;
  // A loss built from the scaled loss's gradients (a gradient penalty) holds the scale: at a
  // scale that enlarges them, its NaN/Inf is their overflow, the scaler's to answer, not
  // the loss code's. Below that it is the loss code's again.
  if ((c.forward == ForwardSource::kLoss || c.forward == ForwardSource::kLossBackward) && run.loss_holds_scale(step.row))
    c.forward = ForwardSource::kNone;
  // The first layer the NaN/Inf reached names it (overflow-origin, with the gradient at its
  // output) where the loss code's fp16 backward overflowed with the scale, the scaler's to
  // answer; and in a second-order loop, whose backward reaches the model's output through the
  // modules' own differentiated backward too (MAML's inner step): no proof of the loss code.
  if (c.forward == ForwardSource::kLossBackward && (run.loss_backward_overflows(step.row) || run.second_order(step.row)))
    c.forward = ForwardSource::kNone;
  if (step.nonfinite_ordered) c.first_gradient = run.layers[std::size_t(step.nonfinite_layers.front())].info.name;
  return c;
}

bool after_nonfinite_update(const Run& run, const StepSummary& step) {
  const std::int64_t from = run.first_step_on_nonfinite_parameters();
  if (from < 0 || step.row.step < from) return false;
  return step.first_nonfinite_module >= 0 || step.gradients_nonfinite() || run.loss_nonfinite(step.row);
}

bool nonfinite_from_module(const Run& run, const StepSummary& step) {
  return step.first_nonfinite_module >= 0 && !run.input_nan(step.row.step) && !after_nonfinite_update(run, step);
}

std::string forward_sentence(ForwardSource forward, const std::string& forward_module) {
  switch (forward) {
    case ForwardSource::kNone: return "";
    case ForwardSource::kModule:
      return "forward went non-finite at " +
             (forward_module.empty() ? std::string("the model's own forward()") : forward_module);
    case ForwardSource::kLoss: return "the loss went NaN/Inf after every probed module's output was finite";
    case ForwardSource::kInput: return "the model's input held NaN/Inf";
    case ForwardSource::kUpdate: return "the parameters already held NaN/Inf";
    case ForwardSource::kLossBackward: return "the gradient reaching the model's output already held NaN/Inf";
  }
  return "";
}

std::string finite_gradients_sentence(const SkippedStep& k) {
  if (!k.gradients_recorded) return "no gradient statistics recorded for this step";
  if (k.nonfinite_rank < 0) return "every gradient recorded on this rank was finite";
  return "every gradient recorded on this rank was finite; rank " + std::to_string(k.nonfinite_rank) + "'s held NaN/Inf (" +
         k.nonfinite_rank_layer + "), and the ranks' scalers skip together";
}

std::string finite_gradients_label(const SkippedStep& k) {
  if (!k.gradients_recorded) return "-";
  if (k.nonfinite_rank < 0) return "none (finite)";
  return "none (rank " + std::to_string(k.nonfinite_rank) + ": " + k.nonfinite_rank_layer + ")";
}

std::string forward_source_name(ForwardSource forward) {
  switch (forward) {
    case ForwardSource::kNone: return "none";
    case ForwardSource::kModule: return "module";
    case ForwardSource::kLoss: return "loss";
    case ForwardSource::kInput: return "input";
    case ForwardSource::kUpdate: return "update";
    case ForwardSource::kLossBackward: return "loss-backward";
  }
  return "none";
}

std::string forward_label(ForwardSource forward, const std::string& forward_module) {
  switch (forward) {
    case ForwardSource::kNone: return "";
    case ForwardSource::kModule: return forward_module.empty() ? "(model forward)" : forward_module;
    case ForwardSource::kLoss: return "(loss)";
    case ForwardSource::kInput: return "(input)";
    case ForwardSource::kUpdate: return "(parameters)";
    case ForwardSource::kLossBackward: return "(loss backward)";
  }
  return "";
}

}  // namespace ampdiag::analyzer
