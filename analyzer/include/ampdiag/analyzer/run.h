// The in-memory model of one run.db (one rank), summarised for the rules and renderers:
// per-layer sample series, per-step causes of overflow, per-module forward overflow.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ampdiag/rundb/rows.h"

namespace ampdiag::analyzer {

// One sampled step of one layer's gradient (16 bytes: a 10 M-row run fits in memory).
struct GradSample {
  std::int32_t step;
  float absmax;            // before unscale; 0 if nothing finite
  float l2;                // L2 norm before unscale; 0 if nothing finite
  std::uint16_t zero_q;    // zeros / numel, in 1/65535
  std::uint8_t nonfinite;  // 1 if the gradient held NaN or Inf
  std::uint8_t sub_q;      // fp16 subnormals / numel, in 1/255
};

struct LayerSummary {
  rundb::LayerRow info;
  std::vector<GradSample> samples;  // in step order
  std::int64_t nonfinite_steps = 0;
  std::int64_t first_nonfinite = 0;  // skipped steps where it went non-finite first in backward
  // The smallest non-zero |g| of its finite samples, before unscale: how close its smallest
  // gradients come to flushing to zero. 0 when no sample had a non-zero value.
  double least_nonzero = 0.0;
  std::int64_t least_nonzero_step = -1;
  // Its exponent histograms (rundb::kHistBins) summed over its finite samples; empty when
  // the agent recorded none.
  std::vector<std::uint64_t> histogram;
  // Its optimizer updates on the steps the agent measured them (half-precision parameters
  // only, the weight_updates table): elements with a finite non-zero gradient, and those
  // whose stored value the step left unchanged.
  std::int64_t update_steps = 0, update_nonzero = 0, update_stalled = 0;
  std::int64_t first_update_step = -1;
};

// One module's calls in one forward (a step's micro-batch), 0-based: how many so far, the
// first that went NaN/Inf, and, of the calls before it whose |output| was finite and not 0,
// the first and the last, their |output|, and how many rose over the one before.
// nonfinite_call -1: none went NaN/Inf (yet).
struct CallGrowth {
  std::int64_t step = -1, micro_batch = -1;
  std::int64_t calls = 0, nonfinite_call = -1, from_call = -1, to_call = -1, rises = 0;
  float from = 0.0f, to = 0.0f;
  // Its |output| rose by a steady factor call after call up to the NaN/Inf one (a recurrence
  // that amplifies its state): rate() is that factor.
  bool grows() const;
  double rate() const;
};

struct ModuleSummary {
  rundb::ModuleRow info;
  std::int64_t nonfinite_steps = 0;   // steps whose output held NaN/Inf
  std::int64_t first_nonfinite = 0;   // steps where it was the first such module in forward order
  std::int64_t first_step = -1;       // the first step it was first
  // The module that finished just before it in the first forward with a row for every call
  // where it was first (-1: none); known: there was such a forward.
  std::int64_t before_first = -1;
  bool before_known = false;
  float max_absmax = 0.0f;            // largest finite |output|
  // Per-element RMS (l2 / sqrt(numel)) of its finite outputs, summed over their rows, and
  // how many: the typical size of what it makes.
  double output_rms_sum = 0.0;
  std::int64_t output_rms_rows = 0;
  // The last step whose output was all zeros (every value of a row holding some), and how
  // many values that row held; -1: none. A model whose output is all zeros (a dead ReLU
  // before it) sends no gradient back.
  std::int64_t zero_step = -1, zero_numel = 0;
  // Recorded steps whose forward it finished last, the model's own output aside: nearest
  // the model's output. Ids follow the order modules *first* finish, which a module first
  // called in a later step (a mixture-of-experts' expert) leaves behind the model's head.
  std::int64_t last_steps = 0;
  // The forward where its output was the most times the largest output of every module
  // that finished before it in that forward: its output then, and that largest. 0: none.
  float jump_absmax = 0.0f, jump_before = 0.0f;
  // In the last forward with a row for every call that ran it: the module that finished just
  // before it (-1: none, it was first), and how many modules finished before it (-1: no
  // such forward). Forward order, which module ids are not (last_steps).
  std::int64_t before_last = -1, position = -1;
  // Its calls in that same first forward where it was first to go NaN/Inf (calls 0: no
  // such forward had a row for every call).
  CallGrowth growth;
};

struct StepSummary {
  rundb::StepRow row;
  // Layers whose gradient held NaN/Inf, earliest in backward order first (ids).
  std::vector<std::int64_t> nonfinite_layers;
  // The layer whose gradient arrived just before the first non-finite one and was still
  // finite: the overflow happened in the backward code between the two. -1: none.
  std::int64_t last_finite_before = -1;
  std::int64_t first_nonfinite_module = -1;  // forward order; -1: none or not probed
  // Whether the first of nonfinite_layers arrived through a gradient hook (its backward
  // order is known); where none did (FSDP2's sharded gradients, set after the reduce-scatter)
  // which layer went NaN/Inf first is unknown.
  bool nonfinite_ordered = false;

  // A gradient held NaN/Inf: the scaler found one, or a layer's statistics did.
  bool gradients_nonfinite() const { return row.found_inf || !nonfinite_layers.empty(); }
};

// Device time (gpu_time) over the profiled steps, by module id (-1: outside every module).
struct GpuTime {
  std::int64_t ns[rundb::kGpuKindCount] = {};
  std::int64_t count[rundb::kGpuKindCount] = {};
  std::int64_t kernel_ns() const;  // every kind but copies
  std::int64_t half_ns() const { return ns[int(rundb::GpuKind::kFloat16)] + ns[int(rundb::GpuKind::kBFloat16)]; }
};

struct GpuProfile {
  std::int64_t steps = 0;  // steps with device rows
  std::map<std::int64_t, GpuTime> modules;
  std::int64_t phase_ns[rundb::kGpuPhaseCount] = {};
  std::int64_t total_ns = 0;  // kernels and copies
};

// meta[key], or `fallback` where the file has no such key.
std::string meta_or(const std::map<std::string, std::string>& meta, const std::string& key, const std::string& fallback);

// A step's layers that went non-finite, as (backward order, layer id), and the layer
// whose gradient was the last finite one before the first of them (-1: none).
struct StepOrder {
  // A gradient no hook saw arrive sorts after every one that did.
  static constexpr std::int64_t kUnordered = INT64_MAX;
  std::vector<std::pair<std::int64_t, std::int64_t>> nonfinite;  // (bwd_order, layer)
  std::int64_t last_finite_before = -1;
  // The layers whose finite gradient arrived before the first of them, in the first
  // kFiniteBeforeSteps such steps of each stretch of steps read (empty in the others): their
  // backward ran first, so they come after it in forward.
  static constexpr std::int64_t kFiniteBeforeSteps = 16;
  std::vector<std::int64_t> finite_before;
};

// How far the reads that built a Run went into its file: run_delta.h reads on from there.
struct RunCursor {
  bool started = false;      // anything read yet
  bool incremental = false;  // the file can be read on from here (false: only whole again)
  std::string run_id;
  std::int64_t last_step = -1, step_rows = 0;  // the last steps row read; how many there were
  std::int64_t last_sample_id = 0;             // the last grad_samples row read
  std::pair<std::int64_t, std::int64_t> act_key{INT64_MIN, INT64_MIN};  // the last act_stats row read
  bool act_step_found = false;  // act_key's step already had its first non-finite module
  // act_key's step's module that finished last so far (-1: none), counted in last_steps
  // once a later step's rows are read, and its micro-batch; the model's own module (path
  // ""), -1: none.
  std::int64_t act_step_last = -1, act_micro_batch = -1, root_module = -1;
  float act_forward_max = 0.0f;  // the largest output so far in act_key's forward
  std::int64_t act_forward_calls = 0;  // modules finished so far in act_key's forward
  // Each module's calls so far in act_key's forward, by module id (a forward with a row for
  // every call), and whether it is the forward its growth was kept from.
  struct Calls {
    CallGrowth growth;
    bool kept = false;
  };
  std::map<std::int64_t, Calls> act_calls;
  std::size_t layers = 0, modules = 0;
  // What gradient and activation rows said about steps whose steps row was not in the file
  // yet: the step gets it once its row is read.
  std::map<std::int64_t, StepOrder> pending_order;
  std::map<std::int64_t, std::int64_t> pending_module;
};

struct Run {
  std::string path;
  std::map<std::string, std::string> meta;
  bool finished = false;
  std::int64_t rank = 0, world_size = 1;
  double fp_max = 65504.0;  // largest finite value of the AMP dtype (fp16 or bf16)
  std::vector<StepSummary> steps;
  std::vector<LayerSummary> layers;   // by layer id
  // By layer id: the layers whose finite gradient arrived before its NaN/Inf one in steps
  // where it went NaN/Inf first (StepOrder::finite_before): where no module was probed, the
  // backward's order is what says which modules run after it in forward.
  std::map<std::int64_t, std::set<std::int64_t>> arrived_before;
  std::vector<ModuleSummary> modules; // by module id
  std::vector<rundb::EventRow> events;
  std::vector<std::int64_t> input_nan_steps;  // steps of the "input-nan" events, sorted
  std::vector<std::int64_t> output_gradient_steps;  // of the "output-gradient-nonfinite" events, sorted
  // Of the "output-gradient-overflow" events, sorted: the float16 gradient reaching the
  // model's output held Inf and no NaN, the scaled gradient's overflow or the loss code's.
  std::vector<std::int64_t> output_overflow_steps;
  std::vector<std::int64_t> forward_dropped_steps;  // of the "forward-dropped" events, sorted
  std::vector<std::int64_t> evaluation_steps;  // of the "evaluation-nonfinite" events, sorted
  // From this step on the loss was built from the scaled loss's own gradients (event
  // "scaled-gradients-in-loss": a gradient penalty through torch.autograd.grad with
  // create_graph=True), so it goes NaN/Inf where they overflow; -1: never.
  std::int64_t scaled_gradients_in_loss_from = -1;
  // From this step on the loop differentiated gradients it took itself (event
  // "gradients-differentiated": torch.autograd.grad with create_graph=True on a loss the
  // scaler did not scale, MAML's inner step), so the step's backward also runs the model's
  // backward in reverse, and the gradient reaching its output carries what that made; -1: never.
  std::int64_t gradients_differentiated_from = -1;
  // The gradient reaching the model's output went NaN/Inf only in steps at loss scales of
  // this and above, in loss code that computes in half precision, while the steps at lower
  // scales stayed clear of it, more of them than chance allows: the loss code's fp16
  // backward overflowing with the scale (a similarity divided by a small temperature),
  // which the scaler answers, not a function whose gradient is NaN/Inf at any scale.
  // Infinity: none such.
  double loss_backward_overflow_from = std::numeric_limits<double>::infinity();
  // The output_overflow_steps are the loss code's own: it computes in half precision (its
  // fp16 backward, log's 1/p of a p near 0, makes the Inf), and they went on down to a
  // scale of kLossOverflowScale or below, where the scaled gradient alone cannot reach
  // 65504 unless the loss code makes values above 512. Else they are the scale's overflow
  // (a cast to float16 at the output), which the scaler answers.
  static constexpr double kLossOverflowScale = 128.0;
  bool output_overflow_in_loss_code = false;
  // The first optimizer step whose update wrote NaN/Inf into the parameters, and every
  // NaN/Inf after it follows from that; -1: none known. Either the first step taken with
  // NaN/Inf gradients (no scaler skipped it), or, where the agent found NaN/Inf in the
  // parameters (event "parameters-nonfinite") before any such step, the last step taken
  // before it: its update made them from finite gradients.
  std::int64_t first_nonfinite_update = -1;
  bool update_from_finite_gradients = false;
  // The step in which the agent found NaN/Inf in the parameters; -1: it found none.
  std::int64_t parameters_found_nonfinite = -1;
  std::vector<rundb::ReplayRow> replays;
  // The agent's precision checks (fp16/bf16 output against FP32), in the order made.
  std::vector<rundb::PrecisionCheckRow> precision_checks;
  // The weight sampler's norms, in step then layer order (none in older files).
  std::vector<rundb::WeightNormRow> weight_norms;
  std::string run_id;  // shared by the ranks of one run; empty in files written before it existed
  std::int64_t grad_rows = 0, act_rows = 0;
  GpuProfile gpu;  // read whole by load_run (not by the incremental reads)
  RunCursor cursor;

  std::string meta_or(const std::string& key, const std::string& fallback) const;
  double init_scale() const;
  // Whether a loss scaler ran (fp16); without one (bf16) there is no scale to judge.
  bool has_scaler() const { return meta_or("scaler_enabled", "1") != "0"; }
  // The agent measured optimizer updates of half-precision parameters (weight_updates).
  bool measured_updates() const {
    for (const auto& l : layers)
      if (l.update_nonzero > 0) return true;
    return false;
  }
  bool fp16() const { return meta_or("amp_dtype", "float16") == "float16"; }
  // Whether the step's loss was recorded: a NaN loss is then a NaN/Inf loss, not a gap.
  bool loss_known(const rundb::StepRow& row) const;
  // A recorded loss that was NaN/Inf.
  bool loss_nonfinite(const rundb::StepRow& row) const;
  // Whether the step's loss was built from its scaled loss's gradients (a gradient penalty)
  // at a scale above 1, which enlarges them: its NaN/Inf is then their overflow, which a
  // lower scale avoids, not a NaN the loss code makes at any scale.
  bool loss_holds_scale(const rundb::StepRow& row) const {
    return scaled_gradients_in_loss_from >= 0 && row.step >= scaled_gradients_in_loss_from && row.scale_before > 1.0;
  }
  // Whether the step's backward differentiated the model's own backward (a second-order
  // loop): NaN/Inf reaching the model's output may then come from the modules' fp16 double
  // backward, not only from the loss code's.
  bool second_order(const rundb::StepRow& row) const {
    return gradients_differentiated_from >= 0 && row.step >= gradients_differentiated_from;
  }
  // Whether NaN/Inf in the gradient reaching the model's output at this step's scale is the
  // loss code's fp16 backward overflowing (loss_backward_overflow_from).
  bool loss_backward_overflows(const rundb::StepRow& row) const { return row.scale_before >= loss_backward_overflow_from; }
  // The first event of that kind, nullptr if none.
  const rundb::EventRow* first_event(const std::string& kind) const;
  // The first event of that kind about `module` (detail "MODULE: ..."), and the detail past
  // "MODULE: "; {nullptr, ""} if none.
  std::pair<const rundb::EventRow*, std::string> module_event(const std::string& kind, const std::string& module) const;
  // The summary of step `step` (steps are in step order); nullptr if the run has none.
  const StepSummary* step_summary(std::int64_t step) const;
  StepSummary* step_summary(std::int64_t step) {
    return const_cast<StepSummary*>(static_cast<const Run&>(*this).step_summary(step));
  }
  // Whether the model's input held NaN in the step (the agent looked: an output was NaN/Inf).
  bool input_nan(std::int64_t step) const;
  // Whether the gradient reaching the model's output held NaN/Inf in the step (the agent's
  // event "output-gradient-nonfinite": made by the loss code's backward).
  bool output_gradient_nonfinite(std::int64_t step) const;
  // An output-gradient-overflow step, where output_overflow_in_loss_code says it is the loss code's.
  bool output_overflow_in_loss(std::int64_t step) const;
  // Whether a forward of the step went NaN/Inf and no backward reached it (the agent's event
  // "forward-dropped": the loop dropped the batch, its loss never given to the scaler).
  bool forward_dropped(std::int64_t step) const;
  // Whether a forward of the model in eval mode went NaN/Inf in the step, gradients on (the
  // agent's event "evaluation-nonfinite": a validation pass without torch.no_grad()).
  bool evaluation_nonfinite(std::int64_t step) const;
  // The parameters held NaN/Inf before the first optimizer step: they came with the model.
  bool parameters_nonfinite_from_start() const { return parameters_found_nonfinite >= 0 && first_nonfinite_update < 0; }
  // The first step that ran with NaN/Inf in its parameters; -1: none known.
  std::int64_t first_step_on_nonfinite_parameters() const {
    return first_nonfinite_update >= 0 ? first_nonfinite_update + 1 : parameters_found_nonfinite;
  }
  // The replay of a module, if the agent did one.
  const rundb::ReplayRow* replay_of(const std::string& module) const;
  // The row of a probed module, or null.
  const ModuleSummary* module_named(const std::string& path) const;
  // Whether module `later` finishes at or after `earlier` in forward: by their places in the
  // last forwards with every call's row that ran them, where both have one; else by module
  // ids, which follow the order modules first finished (a module first called in a later
  // step, a mixture-of-experts' expert, gets an id after the head's). Unknown (false) where
  // either was not probed.
  bool finishes_at_or_after(const std::string& later, const std::string& earlier) const;
  // The probed module with recorded outputs, the model's own ("") aside, that finished its
  // forward last in the most recorded steps: nearest the model's output. Null where none.
  // `zeros`: one whose outputs were only ever zeros counts too.
  const ModuleSummary* last_module(bool zeros = false) const;
};

struct LoadOptions {
  int threads = 0;             // 0: all cores
  bool allow_unfinished = false;
  // Scan every grad_stats row even where the writer's summaries would do (to check them).
  bool full_scan = false;
  // Called now and then with rows read so far and an estimate of the total.
  std::function<void(std::int64_t done, std::int64_t total)> progress;
};

// Reads and summarises a run.db. Throws rundb::RunDbError with one line naming the file
// for anything it cannot use (including a run still being written, unless allowed, and a
// run without steps).
Run load_run(const std::string& path, const LoadOptions& options = {});

// log2(fp_max / absmax): how many doublings of the scale the values could still take.
double headroom_bits(double absmax, double fp_max);

}  // namespace ampdiag::analyzer
