// What the analyzer concludes: findings with evidence and a suggested fix, the cause of
// every skipped step, and a verdict. Plain structs: the CLI and GUI render them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ampdiag::analyzer {

enum class Severity { kInfo = 0, kWarning = 1, kError = 2 };
const char* severity_name(Severity s);

struct Suggestion {
  std::string summary;  // one line: what to do
  std::string python;   // copy-paste snippet
  std::string cpp;      // copy-paste snippet
  // What following it costs, where the run measured it (the device profile); else empty.
  std::string cost = {};
  // On a finding a replay confirmed: a fix no replay has run (its first fix is then not
  // marked "confirmed by replay").
  bool untried = false;
};

struct Finding {
  std::string rule;       // e.g. "overflow-origin"
  Severity severity = Severity::kWarning;
  std::string layer;      // parameter name, when the finding is about one
  std::string module;     // module path to act on (pin, inspect)
  std::vector<std::int64_t> ranks;  // ranks it was seen on (multi-rank runs)
  std::string title;      // one line
  std::string evidence;   // numbers and steps, one or a few lines
  std::vector<std::int64_t> steps;  // the steps the evidence cites (first few)
  double score = 0.0;     // orders findings: the most likely culprit first
  // What the agent's FP32 replays showed (see causes.h): "confirmed" (the module's FP32
  // output was finite), "unconfirmed" (no replay settled it; the evidence says why), or
  // empty (no replay was made).
  std::string confirmation;
  std::vector<Suggestion> suggestions;
  // How a symptom's fix names this finding's cause where it is no overflow ("Fix the
  // NaN/Inf made in ..."): a module that makes NaN from finite inputs in FP32, the loss
  // code after the model's last module. Empty: an overflow, in the module or the model's
  // own forward().
  std::string blame;
  // A forward NaN/Inf made in a module's own code (the model's: module ""): the module that
  // finished just before it was made, after which that code runs. Empty: none or unknown.
  std::string made_after;
};

// Where a step's NaN/Inf came from in forward, as far as the run can tell (causes.h).
enum class ForwardSource {
  kNone,    // the forward stayed finite, or nothing was probed, or only a by-design -inf
  kModule,  // a probed module's output (forward_module; "" is the model's own forward())
  kLoss,    // the loss was NaN/Inf while every probed module's output was finite
  kInput,   // the model's input held NaN (a corrupted batch): the data, not fp16
  kUpdate,  // after an optimizer step that applied NaN/Inf gradients: the parameters hold them
  // The forward stayed finite and the gradient reaching the model's output already held NaN
  // (or Inf, in an output wider than fp16): the loss code's backward made it.
  kLossBackward,
};

struct SkippedStep {
  std::int64_t rank = 0;
  std::int64_t step = 0;
  double scale = 0.0;
  double loss = 0.0;
  std::vector<std::string> nonfinite_layers;  // earliest in backward order first (a few)
  std::int64_t nonfinite_layer_count = 0;
  bool nonfinite_ordered = true;  // false: no backward order was recorded, which went first is unknown
  // Where nonfinite_layers is empty: whether the step had gradient rows (all finite, then),
  // and another rank whose gradients held NaN/Inf at that step (-1: none), with its first
  // such layer: scalers that share found_inf across ranks skip every rank's step for it.
  bool gradients_recorded = false;
  std::int64_t nonfinite_rank = -1;
  std::string nonfinite_rank_layer;
  ForwardSource forward = ForwardSource::kNone;
  std::string forward_module;  // kModule: where the forward's NaN/Inf started; "" is the model's own code
};

// Rule thresholds, with the defaults documented in docs/ANALYZER.md.
struct Thresholds {
  double scale_floor = 128.0;        // scale-collapse: a scale below this is a collapse
  std::int64_t backoff_run = 8;      // scale-collapse: this many back-offs without recovering
  double headroom_bits = 1.0;        // low-headroom: abs-max within this many bits of the max
  double headroom_fraction = 0.5;    // low-headroom: ...in at least this share of sampled steps
  double underflow_fraction = 0.5;   // underflow: zeros + fp16 subnormals above this share
  double skip_rate = 0.10;           // skip-rate: skipped share of steps after calibration
  double rank_bits = 4.0;            // rank-disagreement: abs-max this many bits from the others
  double stalled_fraction = 0.5;     // stalled-updates: share of a layer's updates that rounded away
  double precision_error = 0.1;      // precision-loss: a check's relative L2 error against FP32 from this
};

// One module's device time per profiled step, and the shares of its kernel time by precision.
struct ModuleDeviceTime {
  std::string module;  // "(outside every module)" for work no module range held
  double us_per_step = 0;
  double fp16 = 0, bf16 = 0, fp32 = 0, other = 0;  // shares of its kernel time, 0..1
};

// What the device profiler recorded (AgentOptions::profile / attach(profile=True)).
struct DeviceProfile {
  std::string status;       // "" (not asked for), "unavailable", or the source ("CUPTI activity API")
  std::string unavailable;  // why, when unavailable
  std::int64_t steps = 0;   // profiled steps
  double step_us = 0;       // device time per profiled step (kernels and copies)
  double ampdiag_us = 0;    // ampdiag's own kernels and copies per profiled step
  std::vector<ModuleDeviceTime> modules;  // most time first (a few)
};

// FP8 readiness of the gradients and activations in brief (fp8.h; `ampdiag fp8` has the
// tables), when the run recorded exponent histograms; filled by add_fp8_overview(), not by
// analyze().
struct Fp8Overview {
  bool recorded = false;  // the run has gradient histograms and the overview was computed
  std::int64_t history = 0;
  double fit_share = 0;
  struct Tensor {
    std::string name;  // layer (gradients) or module path (activations)
    double e4m3_normal = 0, e5m2_normal = 0;  // shares, 0..1
  };
  struct Group {
    std::int64_t count = 0, fit_e4m3 = 0, fit_e5m2 = 0;  // layers or modules judged; how many fit
    std::vector<Tensor> least_ready;  // those that do not fit E4M3, least ready first (a few)
  };
  Group gradients;                     // one per layer
  bool activations_recorded = false;   // the run has activation histograms too
  Group activations;                   // one per module
};

struct RunOverview {
  std::string path;
  std::int64_t rank = 0;
  std::int64_t steps = 0, skipped = 0, calibration_skips = 0;
  double first_scale = 0, last_scale = 0, min_scale = 0;
  std::int64_t layers = 0, modules = 0, grad_rows = 0, act_rows = 0;
  bool finished = true;
  // Writing the file failed (meta write_error): why, and how many records never reached it.
  std::string write_error;
  std::int64_t lost_records = 0;
  // Recorded without part of their statistics: steps whose device results never arrived
  // (meta dropped_steps), and records the agent dropped because its writer fell behind.
  std::int64_t dropped_steps = 0, dropped_records = 0;
  // Batches the loop dropped before backward because their forward went NaN/Inf (events
  // forward-dropped: `if not torch.isfinite(loss): continue`): lost, as a skipped step's
  // are, though no step counts them.
  std::int64_t dropped_batches = 0;
  std::string amp_dtype, device, run_id;
  bool has_scaler = true;
  std::int64_t world_size = 1;
  // Skipped steps that are neither calibration nor growth probes, and their share of the
  // steps after calibration: the one skip rate every view and `diff` use.
  std::int64_t harmful_skips = 0;
  double skip_rate = 0.0;
  DeviceProfile device_profile;
  Fp8Overview fp8;
};

struct Report {
  std::vector<RunOverview> runs;
  std::vector<Finding> findings;     // most important first
  std::vector<SkippedStep> skipped;  // every skipped step with its cause
  bool healthy() const;              // no warning or error
};

}  // namespace ampdiag::analyzer
