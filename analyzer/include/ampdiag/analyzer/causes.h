// Where a step's NaN/Inf started, as every view (report, timeline, HTML, GUI) names it:
// one definition, so that no two views disagree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

// The module a NaN/Inf in forward is blamed on, from the first module whose output held
// it and the agent's FP32 replays of it and of its enclosing modules.
struct ForwardCause {
  std::string module;      // the module to act on; empty: the model's own forward()
  std::string first_seen;  // the first module in forward order whose output was NaN/Inf
  // "confirmed": the module's FP32 replay was finite, so pinning it fixes the forward.
  // "unconfirmed": no replay settled it (it raised, could not run, or never ran); `reason`.
  // "": no replay was made at all (replay off, or C++ probes).
  std::string confirmation;
  std::string reason;
  // The NaN/Inf arises in `module`'s own code (between its children): `first_seen` only
  // received it, and its FP32 replay was still NaN/Inf.
  bool own_code = false;
  // `module` makes NaN/Inf from finite inputs in FP32 too (replay outcome "intrinsic"): a
  // -inf mask, or a bug in its code; not fp16's range, and pinning it cannot help.
  bool intrinsic = false;
  // Modules whose FP32 replay was still NaN/Inf: pinning them would not help.
  std::vector<std::string> disproved;
  double fp32_absmax = 0.0;  // of the confirming replay
};

ForwardCause forward_cause(const Run& run, const std::string& first_seen);

// The module that overflowed fp16 in forward after `intrinsic`, one that makes NaN/Inf by
// design (the agent replays the next module once the first is intrinsic): its FP32 replay
// was finite, its output NaN/Inf, and it finishes after `intrinsic` in forward without
// being part of it; the one that was so most often. nullptr: none, and the NaN/Inf that
// reached the loss is `intrinsic`'s own (a flow's exp() beyond float32, not a mask): a
// module that went NaN/Inf before it, or inside it, cannot have sent it on.
const ModuleSummary* overflow_after_intrinsic(const Run& run, const std::string& intrinsic);

// What the timeline and the skipped-steps list say about one step.
struct StepCause {
  // kModule: the forward held NaN/Inf in a probed module, and it mattered (not a module that
  // makes them by design, intrinsic, while the loss was not NaN/Inf: finite, or not
  // recorded). kLoss: the loss was NaN/Inf while every probed module's output was finite,
  // made after them (the loss computation, or the model's own code after its last probed
  // module). kInput: the model's input held NaN (the agent's event "input-nan"), whatever
  // the modules did with it. kUpdate: a step after Run::first_nonfinite_update went
  // NaN/Inf: its parameters held them. kLossBackward: the forward and the loss were finite,
  // and the gradient reaching the model's output already held NaN/Inf (the loss's backward).
  ForwardSource forward = ForwardSource::kNone;
  std::string forward_module;  // kModule: forward_cause(...).module of the step's first non-finite output
  std::string first_gradient;  // the first gradient (backward order) that held NaN/Inf
};

StepCause step_cause(const Run& run, const StepSummary& step);

// The module's buffers that held NaN when its FP32 replay made NaN from finite inputs
// (event "buffers-nan", "PATH: running_var (1 of 8 values NaN)"), or Inf where they held
// none at attach() ("PATH: codebook (float32: 40 of 2048 values Inf, finite at attach())"):
// the part after "PATH: "; empty where none did.
std::string replayed_buffers(const Run& run, const std::string& path);
// Whether those held Inf: training wrote values beyond range into them (an EMA updated in
// float16), so fp16's range is a cause after all.
bool buffers_went_inf(const std::string& buffers);

// Where the step's forward went wrong, in words ("" when it did not): the report's
// skipped-steps list and the GUI's tooltip.
std::string forward_sentence(ForwardSource forward, const std::string& forward_module);
// Whether the step went NaN/Inf anywhere (an output, the loss, a gradient) after an update
// that wrote NaN/Inf into the parameters (Run::first_nonfinite_update).
bool after_nonfinite_update(const Run& run, const StepSummary& step);
// Whether the step's first NaN/Inf module output is for a module to explain: there is one,
// the model's input held no NaN (input-nan), and no earlier update wrote NaN/Inf into the
// parameters (nonfinite-update).
bool nonfinite_from_module(const Run& run, const StepSummary& step);
// A skipped step without NaN/Inf gradients of its own, in words: none recorded, all finite,
// or another rank's held them (the text report), and as the HTML table's cell.
std::string finite_gradients_sentence(const SkippedStep& k);
std::string finite_gradients_label(const SkippedStep& k);
// "none", "module", "loss", "input", "update", "loss-backward": the JSON report's forward_source.
std::string forward_source_name(ForwardSource forward);
// The same in a table cell: the module, "(model forward)", "(loss)" or "(input)".
std::string forward_label(ForwardSource forward, const std::string& forward_module);

}  // namespace ampdiag::analyzer
