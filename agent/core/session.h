// The session core every agent shares (torch-free): the layer and module registry, run
// metadata, once-only events, backward arrival order, the optimizer cycle, the statistics
// engines and the step recorder with its writer thread. The C++ Agent (LibTorch) and the
// Python extension are thin adapters that turn their tensors into TensorRefs and their
// hooks into these calls.
//
// The file may be opened after the session starts (a spawned worker learns its rank only
// at its first step): rows posted before open() are kept and written first.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ampdiag/kernels/cpu_stats.h"
#include "ampdiag/profiler/activity.h"
#include "ampdiag/rundb/rows.h"
#include "device_engine.h"
#include "profile_collector.h"
#include "run_paths.h"
#include "step_recorder.h"

namespace ampdiag::agent {

// The CPU engine as a session uses it: chunks of 32 Ki elements, so that an activation of
// 64 Ki elements (a 8x32x256 batch) runs on two threads; measured 21 -> 13 us a call.
inline kernels::CpuEngineOptions session_cpu_options() {
  kernels::CpuEngineOptions o;
  o.chunk_elements = 1 << 15;
  return o;
}

struct SessionOptions {
  bool overwrite = false;
  RecorderOptions recorder;
  bool histogram = false;
  // Host activations get their full statistics on one regularly recorded step in
  // `activation_every` (steps 0, every * N, ...); on the other steps only a NaN/Inf check,
  // and a row only for an output that holds NaN/Inf. Device activations: every step.
  std::int64_t activation_every = 1;
  kernels::CpuEngineOptions cpu = session_cpu_options();
  // Device time per module, phase and precision on recorded steps (CUPTI). Unavailable
  // (no CUPTI, no device, another profiler): one event, and the run goes on without it.
  bool profile = false;
  // Where activity comes from; null: CUPTI. Tests pass synthetic sources.
  std::function<std::unique_ptr<profiler::ActivitySource>()> profiler_source;
};

// A parameter as the adapter sees it. `key` identifies the tensor for as long as the
// adapter keeps it alive (its address, Python's id()).
struct LayerInfo {
  std::string name, module_path, module_type, dtype, shape;
  std::int64_t numel = 0;
  bool trainable = true;
  std::string source;
};

// What only the adapter knows about the run; the session adds the rest (version, pid,
// sampling, engine, rank).
struct RunMeta {
  std::string source;         // "ampdiag C++ agent"
  std::string torch_version, device, amp_dtype, command_line;
  bool fused_unscale = true;
  bool has_scaler = true;
  double scaler_init_scale = 0, scaler_growth_factor = 0, scaler_backoff_factor = 0;
  std::int64_t scaler_growth_interval = 0;
};

// A batch of gradients at the unscale point, in the order the optimizer holds them.
struct GradBatch {
  const std::int64_t* layers = nullptr;
  const DeviceTensor* tensors = nullptr;
  std::size_t count = 0;
  // Unscale in place as torch's op does (CPU: the host value; device: device pointers).
  bool unscale = false;
  float inv_scale = 1.0f;
  const float* device_inv_scale = nullptr;
  float* device_found_inf = nullptr;
};

class Session {
 public:
  explicit Session(SessionOptions options);
  ~Session();  // = close()
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Creates the run.db (throws rundb::RunDbError for a bad path) and writes what was posted
  // so far. Once only.
  void open(const std::string& db_path, const RankInfo& rank, const std::string& run_id);
  bool opened() const { return recorder_ != nullptr; }
  // Why recording stopped before it began (open failed after training started), for status().
  void failed(const std::string& why) { failure_ = why; }

  // --- registry ----------------------------------------------------------------------
  // A layer id, and whether this call registered it (the adapter then keeps the tensor
  // alive: its key must not be reused while the session runs).
  struct Layer {
    std::int64_t id = -1;
    bool added = false;
    std::string name = {};  // as recorded, where this call registered it
  };
  // Registers a model parameter; a tensor seen before (shared weights) keeps its first id
  // and gets a one-time event. After layers_done() (a parameter added to the model since),
  // its backward arrival is recorded while the room set aside for such lasts; one that took
  // the name of a parameter it replaced (a head swapped in) is "2.weight (from step 20)".
  Layer add_layer(std::uintptr_t key, const LayerInfo& info);
  // The layer of an optimized tensor: a model parameter, or a made-up "optimizer.paramN"
  // (with an event) for one the model does not hold.
  Layer layer_of(std::uintptr_t key, const LayerInfo& foreign);
  // The layer registered under `key`; -1 for a tensor not seen yet.
  std::int64_t find_layer(std::uintptr_t key) const {
    const auto found = layer_ids_.find(key);
    return found == layer_ids_.end() ? -1 : found->second;
  }
  // After the model's parameters: says how many are frozen.
  void layers_done();
  // The module's id, registered on first use.
  std::int64_t module_id(const std::string& path, const std::string& type, const std::string& source,
                         const std::string& inputs);

  void set_meta(const std::string& key, const std::string& value);
  void write_meta(const RunMeta& meta);
  void event(const std::string& kind, const std::string& detail);
  // Once per key for the run. `at_step`: the step the event belongs to, where what it
  // reports was read back from a device after that step ended; it must not lie ahead of
  // the current step (std::invalid_argument).
  void event_once(const std::string& key, const std::string& kind, const std::string& detail,
                  std::optional<std::int64_t> at_step = std::nullopt);
  void replay(const std::string& module, const std::string& outcome, double fp32_absmax, const std::string& reason);
  // A module's output as it ran against the same call in FP32 (rundb::PrecisionCheckRow),
  // for the current step, or `at_step` where the comparison was read back from a device
  // after its step ended. Throws std::invalid_argument for values no comparison gives, or
  // a step not reached.
  void precision_check(const std::string& module, const std::string& dtype, std::int64_t numel, double rel_error,
                       std::int64_t zeroed, double fp32_absmax, std::optional<std::int64_t> at_step = std::nullopt);
  // One layer's weights as the current step's forward uses them (rundb::WeightNormRow), or
  // as step `at_step`'s did: device weights read back after their step. Throws
  // std::invalid_argument for an unknown layer, values no norm has, or a step not reached.
  void weight_norm(std::int64_t layer, double l2, double absmax, std::optional<std::int64_t> at_step = std::nullopt);
  // weight_norm() of `n` layers' host weights (`refs[i]` is layer `layers[i]`) from one
  // statistics pass: the engine's L2, accumulated in double, and abs-max, where torch's
  // norm and abs().max() read each tensor twice (its inf norm on the CPU: 8 ms of a 19 MB
  // model). A tensor holding NaN/Inf has no norm: no row.
  void weight_norms(const std::int64_t* layers, const kernels::TensorRef* refs, std::size_t n);
  // What the optimizer step of `step` did to one half-precision layer: of `nonzero`
  // elements with a finite non-zero gradient, `stalled` kept their value. Throws
  // std::invalid_argument for counts no measurement gives.
  void weight_update(std::int64_t step, std::int64_t layer, std::int64_t nonzero, std::int64_t stalled);

  // --- backward arrival (any thread: autograd's workers call it) -----------------------
  // A layer's place is its first arrival in the last backward of the step that reached it.
  // The adapter says where each backward begins (the training thread, before it runs).
  void backward_began();
  void arrived(std::int64_t layer);
  std::int32_t arrival(std::int64_t layer) const;

  // --- the optimizer cycle (training thread) -------------------------------------------
  // The first hook of a cycle records the step that ended and resets arrival order.
  // Returns whether this call opened the cycle.
  bool begin_cycle();
  bool cycle_open() const { return cycle_open_; }
  // Gradients were checked this cycle (an update() without that only moves the scale).
  bool checked() const { return checked_; }
  // Statistics of the gradients, staged for this step (with arrival order); CPU tensors
  // are computed now, device tensors on their engine. Returns found_inf of what was
  // computed on the host (device results land later).
  bool grads(const GradBatch& batch);
  // Where the last grads() call's host gradients went NaN/Inf in backward: the first
  // non-finite layer in arrival order and the last finite one that arrived before it (-1
  // where none did); {-1, -1} where every host gradient was finite.
  std::pair<std::int64_t, std::int64_t> backward_origin() const { return origin_; }
  // The module both agents name for the last grads() call's first NaN/Inf gradient: the
  // innermost holding backward_origin()'s two layers, unless that holds every model layer
  // (the model, or a DDP wrapper's "module" in it: no place), where the first one's own
  // module; "" where every host gradient was finite (or the model itself is named).
  std::string origin_module() const;
  // The modules of the last grads() call's other NaN/Inf host gradients, in arrival order,
  // each once and at most `limit`: not origin_module() nor inside it (q's gradients going
  // NaN/Inf after k's, two projections of one input). Whether each received them through its
  // output or made its own is for the agents' look at their output gradients to tell.
  std::vector<std::string> nonfinite_modules(std::size_t limit) const;
  // Statistics of one module output at the next forward position (on a host tensor only
  // checked for NaN/Inf outside SessionOptions::activation_every's steps); returns whether
  // it holds NaN/Inf (known at once on the host; false for a device tensor).
  bool activation(std::int64_t module, const DeviceTensor& t, std::int32_t micro_batch);
  // Whether a host tensor holds NaN/Inf, with the activations' check (an unsigned max over
  // its raw bits); records nothing.
  bool host_nonfinite(const kernels::TensorRef& tensor) const { return cpu_.has_nonfinite(tensor); }
  // Device profiling (SessionOptions::profile): what the calling thread launches until
  // end_range() belongs to `module` (-1: none) in `phase`. Returns whether a range opened
  // (false when not profiling this step); end_range() only after true.
  bool begin_range(std::int64_t module, rundb::GpuPhase phase, rundb::GpuKind hint);
  void end_range();
  bool profiling() const { return profile_ != nullptr; }
  // The engine a tensor on `device` goes to (tests and the slow-path event).
  EngineKind engine_for(const Device& device) const;
  // Ends the cycle. adapter_ns, with what add_agent_ns() added: the step's agent_ns. The
  // adapters time their hooks around the calls into the session, so the session counts
  // none of its own (it would count the statistics pass twice). `later`:
  // outcome scalars still on a device, read back without waiting; they complete the step
  // when they land (until then, and if they never do, the step has what `outcome` says).
  void end_step(StepOutcome outcome, std::int64_t adapter_ns, const DeviceOutcome* later = nullptr);
  // An update() after the cycle's update(): the pending step ends at this scale (a host
  // value, or one read back from the device). False when no step is pending.
  bool amend_scale_after(double scale_after);
  bool amend_outcome(const DeviceOutcome& later);
  void add_agent_ns(std::int64_t ns) { agent_ns_ += ns; }
  std::int64_t step() const;

  // Replaces the device engine (tests drive the core with a fake one).
  void set_device_engine(std::unique_ptr<DeviceEngine> engine) { device_engine_ = std::move(engine); }
  kernels::CpuIsa cpu_isa() const { return cpu_.isa(); }

  // Waits (bounded) for the last tickets and finishes the run.db. Idempotent.
  void close();
  RecorderCounters counters() const;

 private:
  // To the writer, or kept until open().
  template <class Row>
  void post(Row row, std::vector<Row>& early, void (WriterThread::*to)(Row));
  void reset_arrival();
  // Creates the device engine on first use; false (with a one-time event) when it cannot run.
  bool device_engine_ready(const Device& device);
  // The engine a drop event names for statistics the device engine did not deliver.
  const char* device_label() const;
  // The read-back of `later` on its device's engine; null when it cannot be asked for (no
  // engine: a one-time event; no free slot).
  std::unique_ptr<Ticket> outcome_ticket(const DeviceOutcome& later);
  void launch_on_device(const kernels::TensorRef* refs, std::size_t n, const DeviceLaunch& launch, LandAs as);
  void start_profiler();

  SessionOptions options_;
  kernels::CpuStatsEngine cpu_;
  std::unique_ptr<DeviceEngine> device_engine_;
  std::unique_ptr<StepRecorder> recorder_;
  std::unique_ptr<ProfileCollector> profile_;  // null unless profiling runs
  bool step_range_ = false;                   // the cycle's own range is open
  std::string failure_;
  bool closed_ = false;

  // Posted before open(), written first.
  std::vector<std::pair<std::string, std::string>> early_meta_;
  std::vector<rundb::LayerRow> early_layers_;
  std::vector<rundb::ModuleRow> early_modules_;
  std::vector<rundb::EventRow> early_events_;

  std::unordered_map<std::uintptr_t, std::int64_t> layer_ids_;
  std::unordered_set<std::string> layer_names_;  // run.db's layers.name is unique
  std::size_t layer_count_ = 0;
  std::int64_t frozen_ = 0;
  std::unordered_map<std::string, std::int64_t> module_ids_;
  std::unordered_set<std::string> events_posted_;

  // Backward arrival: written by autograd's threads, read at the unscale point. Allocated
  // for the model's layers plus room for parameters added to it after attach, whose layers
  // widen arrival_size_ (on the training thread, between backwards); a layer beyond it has
  // no order.
  std::unique_ptr<std::atomic<std::int32_t>[]> arrival_;
  std::pair<std::int64_t, std::int64_t> origin_{-1, -1};  // see backward_origin()
  std::vector<std::pair<std::int32_t, std::int64_t>> nonfinite_;  // (arrival, layer), ascending; see nonfinite_modules()
  // Model layers (add_layer(), not layer_of()'s foreign tensors) -> their module's path, and
  // the innermost module holding them all (set by the first).
  std::unordered_map<std::int64_t, std::string> module_paths_;
  std::optional<std::string> whole_;
  std::size_t arrival_capacity_ = 0;
  std::atomic<std::size_t> arrival_size_{0};
  std::atomic<std::int32_t> next_arrival_{0};
  std::atomic<std::int32_t> backward_start_{0};  // next_arrival_ when the step's last backward began

  bool cycle_open_ = false;
  bool checked_ = false;
  std::int32_t fwd_order_ = 0;
  std::int64_t agent_ns_ = 0;
  std::int64_t step_start_ns_ = 0;

  // Per-call scratch: nothing is allocated on the training thread once warm.
  std::vector<kernels::TensorRef> refs_;
  std::vector<kernels::MutableTensorRef> mrefs_;
  std::vector<std::int64_t> ids_;
  std::vector<kernels::TensorStats> stats_;
  std::vector<std::uint64_t> hist_;
  std::vector<char> launched_;
};

}  // namespace ampdiag::agent
