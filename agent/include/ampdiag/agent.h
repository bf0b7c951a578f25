// ampdiag::Agent: rides along with a LibTorch training loop. Attached to a model and an
// ampdiag::GradScaler, it takes per-layer gradient statistics between backward and
// unscale (fused with the unscale when it can), activation statistics at explicit
// probes, the loss scale and skipped steps, and streams them to a run.db.
//
//   ampdiag::GradScaler scaler;
//   ampdiag::Agent agent(*model, scaler, {.db_path = "run.db"});
//   ... x = agent.probe("blocks.0.attn", x); ...   // in forward, optional
//   scaler.scale(loss).backward(); scaler.step(opt); scaler.update();
//
// Without a scaler (bf16): ampdiag::Agent agent(*model, options); then
// agent.loss(loss).backward(); agent.step(opt);
//
// It never changes the training: parameters after N steps are bit-identical to a run
// without it. The training thread never waits on the disk: when the writer falls behind
// the agent drops samples and counts them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ampdiag {

class GradScaler;

struct AgentOptions {
  std::string db_path = "run.db";   // under torchrun: run.rank{N}.db
  bool overwrite = false;           // replace an existing file instead of refusing
  std::int64_t every = 1;           // record per-layer statistics every N steps
  std::int64_t context_steps = 2;   // ...and this many steps before/after an overflow or scale change
  bool fused_unscale = true;        // do the scaler's unscale in the statistics pass
  bool histogram = false;           // record exponent histograms of the gradients and activations
  // Full statistics of CPU probes on one recorded step in N; on the others only a NaN/Inf
  // check (a row only for a value that holds one). CUDA probes: every recorded step.
  std::int64_t activation_every = 10;
  std::size_t queue_capacity = 1 << 15;  // records between the training and the writer thread
  int threads = 0;                  // own CPU threads for the statistics pass; 0 = torch's intra-op pool
  // The run's precision, "float16" or "bfloat16" (meta amp_dtype). Empty: float16, unless
  // the first probe runs under autocast in bfloat16 (event "amp-dtype"): a GradScaler kept
  // with bf16 autocast would otherwise have bf16 values judged by fp16's range. With
  // autocast off there, the probed output's dtype: float32 (AMP off) or bfloat16.
  std::string amp_dtype;
  // Shared by every rank of the run (meta run_id); empty: derived from the launcher's
  // environment under torchrun, random for one process.
  std::string run_id;
  // On a CUDA device: each module's device time by precision and phase on sampled steps
  // (CUPTI; forward time for the modules wrapped in module_range()). Unavailable (no driver,
  // no device, no CUPTI): one event in run.db, and the run goes on without it.
  bool profile = false;
  // For modules run through Agent::forward(): the first module of a step whose output holds
  // NaN/Inf is run once more in FP32 on a clone (once per module and run), and the result is
  // recorded (replays: finite = confirmed, nonfinite, unconfirmed with the reason).
  bool replay = true;
  // Pin to FP32, from the next step on, up to this many modules whose replay confirmed them
  // as the origin of a NaN/Inf in forward (event "autopin"), or whose precision check found
  // at least half of their output lost (event "autopin-precision"); 0: never. Needs replay.
  std::int64_t autopin = 0;
  // Precision checks of modules run through Agent::forward() on the CPU: one module at a
  // time, round robin, run once more in FP32 on a copy of its input (the same RNG draws),
  // its output compared with the half-precision one (rule precision-loss), within this share
  // of the training's wall time; 0: none.
  double precision_budget = 0.005;
  // The modules the loop already runs in FP32 (Fp32Pins::paths(), as a sample's --pin-fp32
  // gives them): event "pinned-fp32" each, so that the report offers no pin the run has,
  // and where such a module still receives an overflowed gradient it names the module that
  // sends it instead. The paths are the ones the loop gives probe() and forward().
  std::vector<std::string> pinned_fp32;
};

struct AgentStatus {
  std::string db_path;
  std::int64_t steps = 0;
  std::int64_t rows_written = 0;   // records the file holds (committed)
  std::int64_t dropped = 0;        // records dropped because the writer fell behind (queue full)
  std::int64_t lost = 0;           // records that never reached the file because writing failed
  std::int64_t write_errors = 0;
  std::int64_t dropped_steps = 0;  // steps recorded without device statistics that never arrived
  std::string first_error;
};

class Agent;

// What the calling thread launches while it lives belongs to a module's forward in the
// device profile (AgentOptions::profile); does nothing when not profiling.
class ModuleRange {
 public:
  ModuleRange(const ModuleRange&) = delete;
  ModuleRange& operator=(const ModuleRange&) = delete;
  ModuleRange(ModuleRange&& other) noexcept : agent_(other.agent_), open_(other.open_) { other.open_ = false; }
  ~ModuleRange();

 private:
  friend class Agent;
  ModuleRange(Agent* agent, bool open) : agent_(agent), open_(open) {}
  Agent* agent_;
  bool open_;
};

class Agent {
 public:
  // Throws std::invalid_argument (bad options, a disabled or already-observed scaler, a
  // model without parameters, malformed RANK/WORLD_SIZE) or rundb::RunDbError (the db
  // cannot be created) before anything is attached.
  Agent(torch::nn::Module& model, GradScaler& scaler, AgentOptions options = {});
  // Without a loss scaler (bf16 autocast, or AMP off): the loop hands each loss to loss()
  // and steps the optimizer through step(), which mark the step as the scaler's scale() and
  // update() do. The run's precision is bf16 until the first training probe says otherwise.
  //   auto loss = agent.loss(criterion(model->forward(x), y));
  //   loss.backward();
  //   agent.step(optimizer);
  explicit Agent(torch::nn::Module& model, AgentOptions options = {});
  ~Agent();  // detaches, then drains the queue and finishes the run.db
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Records the statistics of x as the output of module `module_path` in this step's
  // forward order, and returns x itself (LibTorch modules have no forward hooks).
  at::Tensor probe(const std::string& module_path, const at::Tensor& x);

  // The model's input `name` for this step (a batch), returned as is. Looked at only when
  // a host probe of the step first holds NaN/Inf: NaN in it is the data's, not fp16's, and
  // the run says so (event "input-nan"), which the report names instead of a module. Only
  // NaN counts: a -inf mask passed in is no corruption.
  //   x = agent.input("images", x);
  at::Tensor input(const std::string& name, const at::Tensor& x);

  // Runs module `module_path`'s forward on x and probes its output (as probe() does); a
  // module pinned by AgentOptions::autopin runs in FP32 (autocast off, fp32 input). `module`
  // is a LibTorch module holder (torch::nn::Linear, TORCH_MODULE(...)); the replay runs on
  // its clone(), so a module that is not Cloneable is replayed as "unconfirmed".
  //   x = x + agent.forward("blocks.0.attn", block->attn, block->norm1(x));
  template <class Holder>
  at::Tensor forward(const std::string& module_path, Holder& module, const at::Tensor& x) {
    using Module = typename Holder::ContainedType;
    return forward_as(
        module_path, [&](const at::Tensor& in) { return at::Tensor(module->forward(in)); },
        [&](const at::Tensor& in) { return at::Tensor(std::dynamic_pointer_cast<Module>(module->clone())->forward(in)); },
        x);
  }
  // forward() for any callable: `run` is the module's forward, `replay` runs it on a copy
  // that may be changed (a replay must leave the model as it was).
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  at::Tensor forward_as(const std::string& module_path, const Forward& run, const Forward& replay, const at::Tensor& x);

  // The device profile's range for module `module_path`'s forward, until the guard goes:
  //   { auto r = agent.module_range("encoder.0"); x = encoder0->forward(x); }
  [[nodiscard]] ModuleRange module_range(const std::string& module_path);

  // The training loop caught `error` and stops: the run.db records it (event
  // "training-raised", with the exception's type and the first line of its message, at the
  // step it was in), so the report covers the steps before it and, for a refusal it knows
  // (clip_grad_norm_'s error_if_nonfinite under a scaler, a GradScaler called out of order),
  // says what fixes it. Once per run, before close(); the destructor then adds nothing
  // while the same exception unwinds.
  //   catch (const std::exception& e) { agent.training_raised(e); throw; }
  void training_raised(const std::exception& error);

  // Without a scaler: `loss`, a loss this step's backward starts from (each micro-batch's
  // with gradient accumulation), recorded and returned as is. Throws std::logic_error on an
  // Agent that watches a GradScaler (scaler.scale() records its losses).
  at::Tensor loss(const at::Tensor& loss);
  // Without a scaler: the gradients' statistics, then optimizer.step(), which runs whatever
  // they hold (nothing skips a step without a scaler: the report names the first NaN/Inf
  // update), then the step is recorded. Throws std::logic_error on an Agent that watches a
  // GradScaler (scaler.step() and scaler.update() do this).
  void step(torch::optim::Optimizer& optimizer);

  // Detaches from the model and scaler and finishes the run.db. Idempotent.
  void close();

  AgentStatus status() const;

 private:
  friend class ModuleRange;
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ampdiag
