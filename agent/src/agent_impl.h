// Agent::Impl, the adapter behind ampdiag::Agent: attaches to a model and, where there is
// one, a GradScaler (as its observer), stages each step's statistics in the session core
// and ends the step at update(), or at the Agent's own step() without a scaler.
// agent.cpp holds the scaler's side, agent_without_scaler.cpp the other.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"
#include "batch_looks.h"
#include "chained_calls.h"
#include "elapsed.h"
#include "gradient_entries.h"
#include "half_updates.h"
#include "precision_checks.h"
#include "replay_pins.h"
#include "session.h"
#include "stale_gradients.h"
#include "tensor_views.h"
#include "weight_norms.h"

namespace ampdiag {

namespace agent_impl {

using agent::Clock;
using agent::ns_since;

struct AddToAgentNs {
  agent::Session* session;
  void operator()(std::int64_t ns) const { session->add_agent_ns(ns); }
};
// The adapter's time on the training thread, added to the step's agent_ns when it goes.
using AgentTime = agent::AddsElapsed<AddToAgentNs>;

}  // namespace agent_impl

class Agent::Impl final : public ScalerObserver {
 public:
  // `scaler` null: a run without one (bf16, or AMP off), whose steps loss() and step() mark.
  Impl(torch::nn::Module& model, GradScaler* scaler, AgentOptions options);
  ~Impl() override {
    // Destroyed by an exception that unwinds the training (a loop's Agent is one of its
    // locals): the run stopped at this step, and the report must not read it as a whole
    // healthy run. The exception itself is out of reach here (it is not being handled yet).
    if (!closed_ && !raised_ && std::uncaught_exceptions() > exceptions_at_start_) {
      try {
        session_.event("training-raised", std::string(kUnwound));
        raised_in();
      } catch (...) {
        // Nothing may leave a destructor during unwinding; the run.db is finished below.
      }
    }
    close();
  }

  at::Tensor probe(const std::string& path, const at::Tensor& x) {
    record(path, x);
    return x;
  }
  at::Tensor input(const std::string& name, const at::Tensor& x);
  at::Tensor forward_as(const std::string& path, const Forward& run, const Forward& replay, const at::Tensor& x);
  // forward_as()'s call of `path` on `x` returned `y`: event "chained-calls" the first time
  // such a call was given the output of the one before it in the same forward.
  void chained_call(const std::string& path, const at::Tensor& x, const at::Tensor& y);
  bool begin_module_range(const std::string& path);
  void end_range() { session_.end_range(); }
  void training_raised(const std::exception& error);
  void close();
  AgentStatus status() const;

  agent_impl::AgentTime agent_time() { return agent_impl::AgentTime(agent_impl::AddToAgentNs{&session_}); }

  void on_scale(const at::Tensor& outputs) override;
  bool on_unscale(UnscaleBatch& batch) override;
  void on_step(bool skipped) override {
    skipped_ = skipped;
    if (skipped) {
      const auto timed = agent_time();
      weight_norms_.step_skipped();
    }
  }
  void on_optimizer(const torch::optim::Optimizer& optimizer, bool starting) override {
    if (starting) {
      {
        const auto timed = agent_time();
        weight_norms_.optimizer_starting(optimizer);
      }
      optimizer_range_ = session_.begin_range(-1, rundb::GpuPhase::kOptimizer, rundb::GpuKind::kOtherKernel);
      if (!closed_) half_updates_.before_step(options_.every);
    } else {
      if (optimizer_range_) session_.end_range();
      half_updates_.after_step();
    }
  }
  void on_update(const ScaleUpdate& update) override;

  // Without a scaler (agent_without_scaler.cpp): a loss of this step, and the optimizer's step
  // with the gradients' statistics before it.
  at::Tensor loss(const at::Tensor& loss);
  void step(torch::optim::Optimizer& optimizer);

 private:
  // Probes x as module `path`'s output; returns whether it was the step's first NaN/Inf
  // and an FP32 replay could explain it (the input held no NaN, the parameters no NaN/Inf).
  // `module_input`: what the module computed it from, where forward() ran it.
  bool record(const std::string& path, const at::Tensor& x, const at::Tensor* module_input = nullptr);
  void register_layers(torch::nn::Module& model);
  // Registers the model's parameter `name` (its arrival hook, weight norms, stalled-update
  // count): the layer it was registered as, not added where it is the same tensor as an
  // earlier name.
  agent::Session::Layer register_parameter(const std::string& name, const at::Tensor& p);
  std::int64_t layer_of(const at::Tensor& param);
  // The type of the model's module at `path`; empty for a path the model does not have.
  std::string module_type(const std::string& path) const {
    const auto type = module_types_.find(path);
    return type == module_types_.end() ? "" : type->second;
  }
  void begin_cycle();
  // Views of the gradients for the statistics pass in views_ and ids_ (copies in copies_
  // where one cannot be read in place). Returns whether every one can be unscaled in place
  // on `scale_device` (null: none is to be unscaled, as without a scaler).
  bool gradient_views(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const at::Device* scale_device);

  AgentOptions options_;
  GradScaler* scaler_;
  std::string db_path_;
  agent::Session session_;
  agent::ReplayPins replay_pins_;
  agent::WeightNorms weight_norms_{session_};
  agent::PrecisionChecks checks_;

  std::unordered_map<std::string, std::string> module_types_;  // path -> type, from the model
  // The model, where a shared_ptr owns it (a ModuleHolder's): looked in again for a tensor
  // the optimizer hands over that it did not hold at attach (a block grown, a head swapped in).
  std::weak_ptr<torch::nn::Module> model_;
  std::vector<at::Tensor> keep_alive_;  // every registered tensor: its address is its key
  std::vector<std::pair<at::Tensor, unsigned>> hooks_;
  std::atomic<int> backward_task_{-1};  // autograd's graph task the last arrival ran in
  agent::HalfUpdates half_updates_{session_};
  std::unique_ptr<agent::StaleGradients> stale_;  // see stale_gradients.h; none without a host probe

  // Per cycle: the losses given to scale() (micro-batches, several losses), summed: on the
  // host for host losses, on the device for device ones (read back with the outcome).
  bool optimizer_range_ = false;
  double loss_sum_ = 0.0;
  at::Tensor device_loss_sum_;
  std::int64_t losses_ = 0;
  bool skipped_ = false;
  bool nonfinite_seen_ = false;  // a probe of this cycle held NaN/Inf
  // The last output recorded this cycle, and whose: a module run through forward() on it,
  // unchanged or viewed, is given that module's output (event "module-input-from", once per
  // module).
  at::Tensor last_output_;
  std::string last_output_path_;
  // The cycle's probed outputs' nodes, marked, not held: a validation pass with gradients on
  // between two steps would keep every batch's graph alive.
  static constexpr std::size_t kStepOutputs = 65536;
  std::vector<agent::NodeMark> step_outputs_;
  std::unordered_set<std::string> inputs_seen_;
  agent::ChainedCalls chains_;  // modules whose calls chain in a forward (event "chained-calls")
  // AgentOptions::amp_dtype was left empty and no training probe has run yet, or the first
  // ran in float32 under a scaler (a warm-up) and autocast has not turned on since.
  bool learn_amp_dtype_ = false;
  bool awaiting_autocast_ = false;
  void learn_amp_dtype(c10::DeviceType device, at::ScalarType output);
  // The cycle's inputs (input()), looked at once a probe holds NaN/Inf.
  agent::BatchLooks batch_;
  // The model's parameters by name, looked at for NaN/Inf in a step whose probe first holds
  // NaN/Inf with no NaN input, until found: an earlier update wrote them, or the model came
  // with them (event parameters-nonfinite). Their modules are not replayed from then on.
  std::vector<std::pair<std::string, at::Tensor>> named_params_;
  bool parameters_nonfinite_ = false;
  bool fp32_gradients_read_ = false;  // the first scaled loss's graph was read (gradient_graph.h)
  agent::GradientEntries entries_;                          // see gradient_entries.h; with options_.replay
  void look_at_parameters();
  bool closed_ = false;
  bool raised_ = false;  // training_raised() recorded the exception
  // The innermost module whose forward() the last exception left (forward_as()'s `run`),
  // for event "training-raised-in"; empty: none did, or a module ran to its end since.
  std::string raised_in_;
  at::Tensor run_module(const std::string& path, const Forward& run, const at::Tensor& x);
  static constexpr int kCodeLooks = 4;  // "input-code" and "module-code" events, a run
  int code_looks_ = 0;
  std::unordered_set<std::string> torch_leaves_;  // paths of torch's own modules without submodules
  void read_code(const char* kind, const std::string& path, const at::Tensor& t, std::size_t outputs,
                 const at::Tensor* input);
  void raised_in();  // event "training-raised-in", where raised_in_ names a module
  // Exceptions in flight when the Agent was made: one made by a destructor that runs during
  // unwinding is not destroyed by that exception.
  const int exceptions_at_start_ = std::uncaught_exceptions();
  static constexpr const char* kUnwound =
      "an exception: the Agent was destroyed while it unwound the training loop (its type and message are the "
      "program's to print)";

  // Per-call scratch, kept to avoid allocating on the training thread.
  std::vector<agent::DeviceTensor> views_;
  std::vector<at::Tensor> copies_;
  std::vector<std::int64_t> ids_;
};

}  // namespace ampdiag
