// The analyzer's rules: each reads one run (or all ranks) and appends findings.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// Steps skipped while the scaler halves its way down from init_scale, before it first
// grows or holds a scale for a few steps in a row (steps that fit may come in between).
std::int64_t calibration_skips(const Run& run);
// The index in run.steps after that descent (calibration.h's rule on the recorded steps),
// and whether step `step_index` is one of its back-offs.
std::size_t calibration_end(const Run& run);
bool is_calibration(const Run& run, std::size_t step_index, std::size_t end);
// A skip right after the scale grew: the scaler probing for room, normal behaviour.
bool is_growth_probe(const Run& run, std::size_t step_index);
// A skip in the back-offs right after a growth probe, at a scale the run had not held for
// calibration.h's kSettledSteps steps in a row before that probe: a growth_interval so short
// (1 grows after every step that fits) that the scale it comes back to was itself a probe
// that fitted once, and the next batch need not. After a scale that held, such a skip is a
// batch that no longer fits, and hurts.
bool answers_growth_probe(const Run& run, std::size_t step_index);
// Skipped steps that are neither calibration, growth probes nor their answers.
std::int64_t harmful_skips(const Run& run);
// The same per step (by index in run.steps).
std::vector<bool> harmful_skip_mask(const Run& run);
// The scale fell below the floor, or every step was a calibration skip (it never settled).
bool scale_collapsed(const Run& run, const Thresholds& t);
// harmful_skips over the steps that were not calibration skips (1 when every step was
// one): the one skip rate of the skip-rate rule, overflow_hurts and RunOverview (diff).
double harmful_skip_rate(const Run& run);
// Whether the run's overflows hurt it: the scale fell below the floor, or harmful skips
// exceed the skip-rate threshold.
bool overflow_hurts(const Run& run, const Thresholds& t);

// Each recorded step's loss scale before it ran, by step.
std::map<std::int64_t, double> scales_before(const Run& run);
// A layer's largest unscaled gradient (|g| / the scale before its step, `scale_of`) in the
// steps where it stayed finite, and that step (-1: none): above the dtype's maximum, the
// true gradients do not fit at any scale >= 1 (overflow-origin).
std::pair<double, std::int64_t> largest_true_gradient(const LayerSummary& layer, const std::map<std::int64_t, double>& scale_of);
// Whether `layer` is a float32 embedding table (autocast looks it up in FP32).
bool float32_embedding(const rundb::LayerRow& layer);
// "1 step", "3 steps".
std::string plural(std::int64_t n, const std::string& noun);
// A share as a whole percentage: "97%".
std::string pct(double share);
// Whether `text` ends with `end`.
bool ends_with(const std::string& text, const std::string& end);
// "3, 7, 11, ..." : the first `limit` steps, and "..." for more.
std::string step_list(const std::vector<std::int64_t>& steps, std::size_t limit = 6);
// A parameter's shape as run.db writes it ("[256, 64, 3, 3]") as numbers; empty where it is
// not such a list.
std::vector<std::int64_t> dims_of(const std::string& shape);
// v with three significant digits ("1.32", "6.55e+04").
std::string three_digits(double v);
// A scale or a count as the report prints it ("%g", a power of two from 1 up whole).
std::string fmt(double v);
// An FP32 replay's largest |output| as the report quotes it, in the evidence and in the fixes
// that cite it alike ("%.6g": 107904, 4.72319e+09).
std::string replay_absmax(double v);
// The middle value of `values` (the upper one of an even count), reordering them; NaN for
// none.
double median_of(std::vector<double>& values);
// Each layer's weights at the first step the agent read them (Run::weight_norms), by layer id.
std::map<std::int64_t, const rundb::WeightNormRow*> first_weight_norms(const Run& run);
// Whether a parameter's name is a weight's: its last part holds "weight", or it is a
// parametrized weight's original (M.parametrizations.weight.original).
bool weight_named(const std::string& name);
// Whether `layer` is a weight matrix or kernel whose gain can be read (at least 16 values,
// a weight by name: weight, in_proj_weight, weight_ih_l0, parametrizations.weight.original),
// not an embedding table.
bool weight_matrix(const rundb::LayerRow& layer);
// Each name a parameter was registered under besides its first, with the layer that records
// it (event "shared-parameter": "lm_head.weight is the same tensor as layer 0").
std::vector<std::pair<std::string, std::int64_t>> shared_names(const Run& run);
// The per-element RMS of `layer`'s weights, averaged over the rows the agent read; 0: none.
double mean_weight_rms(const Run& run, const LayerSummary& layer);
// A parameter dtype of a model stored in half precision (the layers table's name).
bool half_dtype(const std::string& dtype);

// The loss grew by orders of magnitude while finite before NaN/Inf came (see
// rules_divergence.cpp); `found` false where it did not.
struct Divergence {
  bool found = false;
  double baseline = 0.0, peak = 0.0;
  std::int64_t rise = -1, onset = -1, peak_step = -1, first_nonfinite_loss = -1;
  // How many times its start it grew: "2.3e+05x", "1500x".
  std::string factor() const;
};
Divergence find_divergence(const Run& run);
// Where a cause shows is not why: the findings in `out` whose first step is `from_step` or later
// that name a culprit (forward-nonfinite, overflow-origin, loss-backward) become warnings
// noting `after`, their first fix `see` the cause's finding; scale-collapse and skip-rate's
// fix becomes `see` alone.
void point_to_cause(std::vector<Finding>& out, std::int64_t from_step, const std::string& see, const std::string& after);
// Run after the other rules of the run: the culprits it finds from the climb on point to it.
void loss_divergence(const Run& run, std::vector<Finding>& out);
// The run's optimizer applied gradients still multiplied by the loss scale (event
// optimizer-outside-scaler in its scaler.step()-forgotten form).
bool updates_held_scale(const Run& run);
// An optimizer stepped outside scaler.step() (event optimizer-outside-scaler).
void optimizer_outside_scaler(const Run& run, std::vector<Finding>& out);
// backward() on the loss scaler.scale() received, not on its output (Python agent's event).
void unscaled_backward(const Run& run, std::vector<Finding>& out);
// Skipped steps whose scale did not back off: an error above the skip-rate threshold's
// share of the steps. After overflow-origin and skip-rate, whose findings on those steps
// point to it.
void scale_held(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// Rows a batch does not touch (tokens, positions not in it) get exact-zero gradients that
// no loss scale would change: an embedding's zeros are neither underflow nor a dead layer.
bool embedding_like(const rundb::LayerRow& layer);
// Most of the trained values got exactly zero gradients in every recorded step, while
// others did not (a dead ReLU): a warning.
void dead_layers(const Run& run, std::vector<Finding>& out);
// Most of the values an optimizer holds never received a gradient (event
// "parameters-unreached"): a warning.
void unreached_layers(const Run& run, std::vector<Finding>& out);
// An evaluation between the steps (eval mode, gradients off) whose output went NaN/Inf
// (Python agent's event evaluation-output-nonfinite): a warning naming the first module.
void evaluation_overflow(const Run& run, std::vector<Finding>& out);
// The training raised inside the Python agent's block, or past the C++ Agent (event
// training-raised): an error where it was clip_grad_norm_(error_if_nonfinite=True) refusing
// gradients a loss scaler skips, else a warning, with the fix where the exception names one.
void training_raised(const Run& run, std::vector<Finding>& out);
// Whether a raised exception's text is torch's clip_grad_norm_ refusing a NaN/Inf norm.
bool clip_refused_nonfinite(const std::string& raised);
// What to do about that in a loop with a GradScaler (one sentence).
std::string clip_with_scaler_fix();
// What to do about an exception the run raised (event training-raised's detail), where the
// exception says: the clip refusal under a scaler, a GradScaler given float16 parameters or
// called out of order; empty for any other.
std::string raised_fix(const Run& run, const std::string& raised);
// What a step's recorded gradient rows say together (every layer's row of that step).
struct StepGradients {
  double sumsq = 0.0;     // of the rows' l2: the step's total norm squared, before unscale
  bool finite = true;     // no row held NaN/Inf
  bool all_zero = true;   // every row was exactly zero (abs-max 0, finite)
};
// By step, the steps that recorded gradient rows.
std::map<std::int64_t, StepGradients> gradients_by_step(const Run& run);
// zero_grad() forgotten between optimizer steps (Python agent's event); the overflows,
// divergence and collapse found in `out` from then on point to it. Runs after them.
void gradients_not_zeroed(const Run& run, std::vector<Finding>& out);
// torch's fused SGD created its momentum buffers in a step the scaler skipped, leaving them
// unfilled (Python agent's event fused-momentum-uninitialised).
bool fused_momentum_uninitialised(const Run& run);
// That as an error; the overflows from the first applied step on point to it. Runs after them.
void fused_sgd_momentum(const Run& run, std::vector<Finding>& out);
// zero_grad(set_to_none=False) between backward and the optimizer step: all-zero gradients.
void gradients_cleared(const Run& run, const std::map<std::int64_t, StepGradients>& by_step,
                       std::vector<Finding>& out);
// zero_grad() inside the loop over micro-batches (Python agent's events): an error where it
// happens at most steps, a warning where a few batches were dropped.
void accumulated_gradients_cleared(const Run& run, std::vector<Finding>& out);
// clip_grad_norm_ before scaler.unscale_(): the scaled gradients' norm pinned at max_norm.
void clip_before_unscale(const Run& run, const std::map<std::int64_t, StepGradients>& by_step,
                         std::vector<Finding>& out);
void scale_collapse(const Run& run, const Thresholds& t, std::vector<Finding>& out);
void overflow_origin(const Run& run, const Thresholds& t, std::vector<Finding>& out);
void forward_nonfinite(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// A warning with a pin where a layer underflows at the scale the limiting layer allows
// (`out` already holds this run's underflow findings); else info: the limit costs nothing.
void low_headroom(const Run& run, const Thresholds& t, std::vector<Finding>& out);
void underflow(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// Three or more underflow findings that the scale lifts, with the same first fix, made one
// (after the rules that add to each: oversized-weights).
void group_underflows(std::vector<Finding>& found);
// Three or more overflow-origin information findings whose skips only calibrated the scale
// or answered its growth probes, made one, and so three or more of those first only above
// the floor that name the same module below it (after every rule that reads them).
void group_calibration_overflows(std::vector<Finding>& found);
void skip_rate(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// Modules the agent pinned itself (events "autopin"): info, with the skips after the pin.
void autopin(const Run& run, std::vector<Finding>& out);
// Parameters stored in half precision (no FP32 master weights): layers whose updates mostly
// round away (warning), else one info finding that the run keeps such parameters.
void half_parameters(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// The gradient reaching the model's output held NaN/Inf while the forward and the loss were
// finite (event "output-gradient-nonfinite"): error, fix in the loss code's backward.
void loss_backward(const Run& run, std::vector<Finding>& out);
// scaler.scale() received a float16 loss (event "half-loss"): warning, fix in the loss.
void half_loss(const Run& run, std::vector<Finding>& out);
// Whether the run's loss was float16 (event "half-loss").
bool has_half_loss(const Run& run);
// A step skipped at a scale above fp16's largest value with a float16 loss: the loss's own
// gradient (the scale) was Inf, whatever the layers did.
bool half_loss_skip(const StepSummary& s);
// The first optimizer step taken with NaN/Inf gradients (Run::first_nonfinite_update): error.
void nonfinite_update(const Run& run, std::vector<Finding>& out);
// Opacus's per-sample gradients under a GradScaler (Python agent's event per-sample-gradients):
// warning; error where they held NaN/Inf at a step the scaler applied.
void per_sample_gradients(const Run& run, std::vector<Finding>& out);
// The small layer scales of the block holding `layer`, in words for the evidence; empty where
// there is none (layer_scales.cpp).
std::string small_layer_scales(const Run& run, const LayerSummary& layer);
// The first event per-sample-nonfinite at a step the scaler applied, or null.
const rundb::EventRow* applied_per_sample_nonfinite(const Run& run);
// Its fix: DP-SGD without a GradScaler, in bfloat16.
Suggestion per_sample_fix(const Run& run);
// A weight matrix whose values were all below float16's smallest positive value (2^-24) at a
// reading, in an fp16 run, while its module's output was all zeros: autocast's cast made them
// zeros. `reading` is its reading at or before `zero_step` (its module's last all-zero
// output), `since` the first of the readings below range up to it; `in_range` the first later
// reading fp16 holds (-1: none), its largest |value|.
struct FlushedLayer {
  const LayerSummary* layer = nullptr;
  const rundb::WeightNormRow* reading = nullptr;
  std::int64_t zero_step = -1;
  std::int64_t since = -1;
  std::int64_t in_range = -1;
  double in_range_absmax = 0.0;
};
std::vector<FlushedLayer> flushed_layers(const Run& run);
// Whether a layer of `flushed` inside `module` was flushed at `step`.
bool flushed_at(const std::vector<FlushedLayer>& flushed, const std::string& module, std::int64_t step);
// Weights that float16 holds none of (flushed_layers): error where they stayed so, a warning
// where the optimizer's steps lifted them into range.
void flushed_weights(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// A module whose fp16/bf16 output is far from FP32's in most of the agent's precision checks
// (Run::precision_checks), the innermost such: error where most of it is wrong, else warning.
void precision_loss(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// The weights of the module that overflowed first (the model's, if none is named) grew many
// times over in the steps before the first NaN/Inf (Run::weight_norms): error, the overflow
// findings from then on point to it. Runs after them, before gradients_not_zeroed.
void weight_growth(const Run& run, const Thresholds& t, std::vector<Finding>& out);
// A layer whose weights' gain (RMS times the square root of its fan-in) was far above any
// standard initialisation's at their first reading (Run::weight_norms): a warning where an
// overflow finding's module is it or after it in forward order, else info. Runs after them.
void oversized_weights(const Run& run, std::vector<Finding>& out);
// The re-initialisation that leads a finding of gradients too large for the scale, where the
// model's outputs are large (`maker` makes them, reaching |output| `reach`; the loss is about
// `loss`): of `maker`'s weight that oversized-weights counts, else of the most oversized
// layer, whose large outputs reach the ones after it. None where no layer is oversized.
std::optional<Suggestion> reinitialise_for_outputs(const Run& run, const std::string& maker, double reach, double loss);
// The re-initialisation that leads a finding whose NaN/Inf gradients `sender`'s backward
// sends back to `receiver`, where `sender` holds a weight that oversized-weights counts. None
// where it holds no such weight.
std::optional<Suggestion> reinitialise_sender(const Run& run, const std::string& sender, const std::string& receiver);
// The look at `sender`'s backward code where it holds no parameters: no weight of its own
// enlarges the gradient it sends back to `receiver`, its code does (a gradient reversal's
// -lambda * g, a constant factor, a division by a small value). Untried. None where it holds
// parameters, is one of torch's own modules (by its source), or was not probed.
std::optional<Suggestion> sender_code_fix(const Run& run, const std::string& sender, const std::string& receiver);
// An overflow-origin finding of `out` (for `module`; any where empty) that leads with that
// look: its module, the sender, the step the sender was seen at, and the look. None where
// none does (the symptoms of its enlarged gradients, weight growth and a diverging loss, then
// keep the learning rate first).
struct SenderCode {
  std::string receiver, sender;
  std::int64_t step = -1;
  Suggestion look;
};
std::optional<SenderCode> sender_code_in(const Run& run, const std::vector<Finding>& out, const std::string& module);
// The re-initialisation that leads a finding whose module's own backward overflowed, where the
// most oversized layer (oversized-weights) is at or after `module` in forward order: the
// gradients reaching `module` passed back through it. Both probed, by their places in forward;
// else (a LibTorch model whose modules no agent.forward() ran) it is `module` itself or one of
// `ran_before`, the modules whose gradient arrived before `module`'s first NaN/Inf one in its
// skips. None where there is none. `inside`, where given, says whether that layer is
// `module`'s own or inside it.
std::optional<Suggestion> reinitialise_after(const Run& run, const std::string& module,
                                             const std::set<std::string>& ran_before, bool* inside = nullptr);
// Puts `reinit` before the finding's look for a singular function in its backward, which it
// rewords as the other case, and says in the evidence how near fp16's range (`fp_max`) the
// gradients came where they stayed finite (`true_max`). False where there is no such look.
bool lead_the_look(const Suggestion& reinit, double true_max, double fp_max, Finding& f);
// Turns a fix that follows such a re-initialisation ("Run X in FP32 ...", "Train in bfloat16
// ...") into the fix for a gain that is there by design ("Where that gain is by design, run X
// in FP32 ...").
void by_design(Suggestion& pin);
void rank_disagreement(const std::vector<Run>& runs, const Thresholds& t, std::vector<Finding>& out);

}  // namespace ampdiag::analyzer::rules
