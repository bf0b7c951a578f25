// Agent: attaches to a model and a GradScaler, stages each step's statistics, decides
// what to record at update() and hands fixed-size records to the writer thread.
#include "ampdiag/agent.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/nn/module.h>
#include <torch/version.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <memory>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "ampdiag/grad_scaler.h"
#include "ampdiag/pin_fp32.h"
#include "agent_setup.h"
#include "batch_looks.h"
#include "half_updates.h"
#include "precision_checks.h"
#include "replay_pins.h"
#include "run_paths.h"
#include "session.h"
#include "stale_gradients.h"
#include "elapsed.h"
#include "tensor_views.h"
#include "weight_norms.h"

namespace ampdiag {

namespace {

using agent::Clock;
using agent::ns_since;

struct AddToAgentNs {
  agent::Session* session;
  void operator()(std::int64_t ns) const { session->add_agent_ns(ns); }
};
// The adapter's time on the training thread, added to the step's agent_ns when it goes.
using AgentTime = agent::AddsElapsed<AddToAgentNs>;

}  // namespace

class Agent::Impl final : public ScalerObserver {
 public:
  Impl(torch::nn::Module& model, GradScaler& scaler, AgentOptions options);
  ~Impl() override {
    // Destroyed by an exception that unwinds the training (a loop's Agent is one of its
    // locals): the run stopped at this step, and the report must not read it as a whole
    // healthy run. The exception itself is out of reach here (it is not being handled yet).
    if (!closed_ && !raised_ && std::uncaught_exceptions() > exceptions_at_start_) {
      try {
        session_.event("training-raised", std::string(kUnwound));
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
  bool begin_module_range(const std::string& path);
  void end_range() { session_.end_range(); }
  void training_raised(const std::exception& error);
  void close();
  AgentStatus status() const;

  AgentTime agent_time() { return AgentTime(AddToAgentNs{&session_}); }

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
  std::unordered_set<std::string> inputs_seen_;
  // AgentOptions::amp_dtype was left empty and no training probe has run yet.
  bool learn_amp_dtype_ = false;
  void learn_amp_dtype(c10::DeviceType device, at::ScalarType output);
  // The cycle's inputs (input()), looked at once a probe holds NaN/Inf.
  agent::BatchLooks batch_;
  // The model's parameters by name, looked at for NaN/Inf in a step whose probe first holds
  // NaN/Inf with no NaN input, until found: an earlier update wrote them, or the model came
  // with them (event parameters-nonfinite). Their modules are not replayed from then on.
  std::vector<std::pair<std::string, at::Tensor>> named_params_;
  bool parameters_nonfinite_ = false;
  void look_at_parameters();
  bool closed_ = false;
  bool raised_ = false;  // training_raised() recorded the exception
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

namespace {

std::uintptr_t key_of(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.unsafeGetTensorImpl()); }

}  // namespace

Agent::Impl::Impl(torch::nn::Module& model, GradScaler& scaler, AgentOptions options)
    : options_(std::move(options)),
      scaler_(&scaler),
      session_(agent::session_options(options_)),
      replay_pins_(session_, options_.replay, options_.autopin),
      checks_(session_, options_.precision_budget),
      batch_(session_) {
  if (options_.autopin < 0) throw std::invalid_argument("AgentOptions.autopin must be >= 0 (0: never pin)");
  if (options_.autopin > 0 && !options_.replay)
    throw std::invalid_argument("AgentOptions.autopin needs replay: it pins only what an FP32 replay confirmed");
  if (!scaler.is_enabled())
    throw std::invalid_argument(
        "ampdiag::Agent: the GradScaler is disabled, so there is no loss scale to watch; enable it "
        "(fp16) or train without a scaler (bf16)");
  if (scaler.observer())
    throw std::invalid_argument("ampdiag::Agent: this GradScaler already has an agent attached; close() it first");
  if (model.parameters(/*recurse=*/true).empty())
    throw std::invalid_argument("ampdiag::Agent: the model has no parameters: nothing to watch");

  const agent::RankInfo rank = agent::rank_from_environment();
  db_path_ = agent::rank_db_path(options_.db_path, rank);
  // Opened here, on the caller's thread: a bad path fails now, before training starts.
  session_.open(db_path_, rank, options_.run_id);

  register_layers(model);
  agent::RunMeta meta;
  meta.source = "ampdiag C++ agent";
  meta.torch_version = TORCH_VERSION;
  meta.device = keep_alive_.empty() ? "cpu" : keep_alive_.front().device().str();
  meta.amp_dtype = options_.amp_dtype.empty() ? "float16" : options_.amp_dtype;
  learn_amp_dtype_ = options_.amp_dtype.empty();
  meta.command_line = agent::command_line();
  meta.fused_unscale = options_.fused_unscale;
  meta.scaler_init_scale = scaler.get_scale();
  meta.scaler_growth_factor = scaler.get_growth_factor();
  meta.scaler_backoff_factor = scaler.get_backoff_factor();
  meta.scaler_growth_interval = scaler.get_growth_interval();
  session_.write_meta(meta);
  // The analyzer offers no pin that the run already had (set: each path once).
  for (const auto& path : std::set<std::string>(options_.pinned_fp32.begin(), options_.pinned_fp32.end()))
    session_.event("pinned-fp32", path);
  scaler.set_observer(this);
}

agent::Session::Layer Agent::Impl::register_parameter(const std::string& name, const at::Tensor& p) {
  agent::LayerInfo info = agent::layer_info(p);
  info.name = name;
  const auto dot = info.name.rfind('.');
  info.module_path = dot == std::string::npos ? "" : info.name.substr(0, dot);
  info.module_type = module_type(info.module_path);
  const auto layer = session_.add_layer(key_of(p), info);
  if (!layer.added) return layer;  // shared with an earlier name
  keep_alive_.push_back(p);
  named_params_.emplace_back(info.name, p);
  weight_norms_.add(layer.id, p);
  if (!p.requires_grad()) return layer;
  if (agent::half_precision(p.scalar_type())) half_updates_.add(layer.id, p);
  agent::Session* session = &session_;
  const std::int64_t id = layer.id;
  hooks_.emplace_back(p, p.register_hook([session, id](const at::Tensor&) { session->arrived(id); }));
  return layer;
}

void Agent::Impl::register_layers(torch::nn::Module& model) {
  model_ = model.weak_from_this();
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true))
    module_types_[item.key()] = agent::module_type_name(*item.value());
  for (const auto& item : model.named_parameters(/*recurse=*/true)) register_parameter(item.key(), item.value());
  if (const at::Tensor* probe = agent::StaleGradients::probe_of(named_params_)) {
    const auto named = std::find_if(named_params_.begin(), named_params_.end(),
                                    [&](const auto& n) { return &n.second == probe; });
    stale_ = std::make_unique<agent::StaleGradients>(*probe, named->first);
    agent::StaleGradients* stale = stale_.get();
    agent::Session* session = &session_;
    at::Tensor p = *probe;
    hooks_.emplace_back(p, p.register_hook([stale, session](const at::Tensor&) { stale->on_gradient(session->step()); }));
  }
  session_.layers_done();
}

std::int64_t Agent::Impl::layer_of(const at::Tensor& param) {
  const std::int64_t known = session_.find_layer(key_of(param));
  if (known >= 0) return known;
  if (const auto model = model_.lock()) {
    for (const auto& item : model->named_parameters(/*recurse=*/true)) {
      if (!item.value().is_same(param)) continue;
      for (const auto& m : model->named_modules(/*name_prefix=*/"", /*include_self=*/true))
        module_types_.emplace(m.key(), agent::module_type_name(*m.value()));
      const auto layer = register_parameter(item.key(), param);
      if (layer.added)
        session_.event_once("added:" + layer.name, "parameters-added",
                            layer.name + " was added to the model after the Agent was made: its gradients are "
                                         "recorded from this step, in backward order from the next; probes of its "
                                         "module work as any other's");
      return session_.find_layer(key_of(param));
    }
  }
  const auto layer = session_.layer_of(key_of(param), agent::layer_info(param));
  if (layer.added) keep_alive_.push_back(param);
  return layer.id;
}

bool Agent::Impl::record(const std::string& path, const at::Tensor& x, const at::Tensor* module_input) {
  if (closed_ || !x.defined()) return false;
  if (!at::isFloatingType(x.scalar_type())) {
    session_.event_once("probe-type:" + path, "warning",
                        "probe " + path + " saw a " + agent::dtype_name(x.scalar_type()) +
                            " tensor; only floating-point outputs have statistics");
    return false;
  }
  const auto timed = agent_time();
  begin_cycle();
  last_output_ = x;
  last_output_path_ = path;
  if (learn_amp_dtype_) learn_amp_dtype(x.device().type(), x.scalar_type());
  at::Tensor copy;
  agent::DeviceTensor view;
  bool first_nonfinite = false;
  if (agent::stats_view(x, copy, view)) {
    const std::int64_t module = session_.module_id(path, module_type(path), "", "");
    // The forward of micro-batch k runs before its k-th scale() call. (The Python agent
    // counts forwards that follow a backward; autograd hooks here may run on other threads.)
    // Known at once for host tensors only: a device tensor's result lands later.
    first_nonfinite = session_.activation(module, view, std::int32_t(losses_)) && !nonfinite_seen_;
    nonfinite_seen_ = nonfinite_seen_ || first_nonfinite;
    if (first_nonfinite) {
      // A NaN batch or NaN weights are no fp16 overflow: a replay would only say "intrinsic".
      if (batch_.nonfinite(module_input)) first_nonfinite = false;
      else look_at_parameters();
    }
  }
  return first_nonfinite && !parameters_nonfinite_;
}

at::Tensor Agent::Impl::input(const std::string& name, const at::Tensor& x) {
  if (closed_ || !x.defined() || !x.is_floating_point()) return x;
  begin_cycle();
  batch_.add(name, x);
  return x;
}

// The first training probe's autocast dtype, where the options left the run's to it. With
// autocast off, the probed output's own dtype: a float32 one is a run with AMP off, which
// was judged by fp16's range (an fp16 model's stays float16).
void Agent::Impl::learn_amp_dtype(c10::DeviceType device, at::ScalarType output) {
  if (!at::GradMode::is_enabled()) return;  // an evaluation: wait for a training forward
  learn_amp_dtype_ = false;
  if (!at::autocast::is_autocast_enabled(device)) {
    if (output != at::kFloat && output != at::kBFloat16) return;
    const std::string seen = output == at::kFloat ? "float32" : "bfloat16";
    session_.set_meta("amp_dtype", seen);
    session_.event("amp-dtype", "autocast was off at the first training probe, whose output was " + seen +
                                    ": the run is judged in " + seen +
                                    ", not the float16 AgentOptions::amp_dtype left empty assumed");
    return;
  }
  if (at::autocast::get_autocast_dtype(device) != at::kBFloat16) return;
  session_.set_meta("amp_dtype", "bfloat16");
  session_.event("amp-dtype", "autocast ran in bfloat16, not the float16 AgentOptions::amp_dtype left empty assumed: "
                              "the run is judged in bfloat16 (bfloat16 needs no GradScaler)");
}

// As the Python agent words it. Host parameters only, for the reason input() gives.
void Agent::Impl::look_at_parameters() {
  if (parameters_nonfinite_) return;
  std::vector<std::string> bad;
  std::size_t total = 0;
  for (const auto& [name, p] : named_params_) {
    if (!p.device().is_cpu() || !p.is_floating_point()) continue;
    ++total;
    // A frozen parameter's -inf is a mask kept as a parameter, by design: NaN only there.
    const at::Tensor d = p.detach();
    if (p.requires_grad() ? !at::isfinite(d).all().item<bool>() : at::isnan(d).any().item<bool>()) bad.push_back(name);
  }
  if (bad.empty()) return;
  parameters_nonfinite_ = true;
  std::string listed;
  for (std::size_t i = 0; i < bad.size() && i < 5; ++i) listed += (i ? ", " : "") + bad[i];
  if (bad.size() > 5) listed += " (+" + std::to_string(bad.size() - 5) + " more)";
  session_.event("parameters-nonfinite",
                 std::to_string(bad.size()) + " of " + std::to_string(total) + " parameter tensors: " + listed);
}

at::Tensor Agent::Impl::forward_as(const std::string& path, const Forward& run, const Forward& replay,
                                   const at::Tensor& x) {
  if (closed_) return run(x);
  begin_cycle();
  at::Tensor y;
  if (replay_pins_.pinned(path)) {
    AutocastDisabled off;
    y = run(to_fp32(x));
    record(path, y);
    return y;
  }
  if (inputs_seen_.insert(path).second && last_output_.defined() &&
      (x.is_same(last_output_) || (x.is_view() && x._base().is_same(last_output_))))
    session_.event_once("module-input-from:" + path, "module-input-from", path + ": " + last_output_path_);
  const bool check = checks_.wants(path, x);
  if (check) checks_.before(x);
  y = run(x);
  if (record(path, y, &x)) {
    replay_pins_.nonfinite_output(path, replay, x, batch_.viewed_by(x) != nullptr);
  } else if (check) {
    const auto timed = agent_time();
    replay_pins_.lossy_output(path, checks_.after(path, y, replay));
  }
  return y;
}

bool Agent::Impl::begin_module_range(const std::string& path) {
  if (closed_ || !session_.profiling()) return false;
  begin_cycle();
  const std::int64_t module = session_.module_id(path, module_type(path), "", "");
  // Autocast's dtype where it is on (the kernels of a module under autocast mostly run in
  // it), else fp32; kernel names decide where they say.
  rundb::GpuKind hint = rundb::GpuKind::kFloat32;
  if (at::autocast::is_autocast_enabled(at::kCUDA))
    hint = at::autocast::get_autocast_dtype(at::kCUDA) == at::kBFloat16 ? rundb::GpuKind::kBFloat16 : rundb::GpuKind::kFloat16;
  return session_.begin_range(module, rundb::GpuPhase::kForward, hint);
}

void Agent::Impl::begin_cycle() {
  if (!session_.begin_cycle()) return;
  if (stale_) stale_->cycle_began();
  replay_pins_.announce();
  checks_.step_began();
  nonfinite_seen_ = false;
  last_output_ = at::Tensor();  // held no longer than its cycle
  batch_.step_began();
  loss_sum_ = 0.0;
  device_loss_sum_ = at::Tensor();
  losses_ = 0;
}

void Agent::Impl::on_scale(const at::Tensor& outputs) {
  const auto timed = agent_time();
  begin_cycle();
  // A non-scalar output (backward with an explicit gradient) is no loss: counting it as
  // NaN would report a NaN loss that never was. A device loss is summed on its device
  // (reading it here would wait for the device) and read back with the step's outcome.
  // Its gradient starts as the scale itself, in fp16: the analyzer says what that costs.
  if (outputs.scalar_type() == at::kHalf)
    session_.event_once("half-loss", "half-loss", "scaler.scale() received a float16 loss");
  if (outputs.numel() == 1 && at::isFloatingType(outputs.scalar_type())) {
    const at::Tensor loss = outputs.detach().reshape({}).to(at::kDouble);
    if (outputs.device().is_cpu()) {
      loss_sum_ += loss.item<double>();
    } else {
      const at::Tensor here = device_loss_sum_.defined() ? loss.to(device_loss_sum_.device(), /*non_blocking=*/true) : loss;
      device_loss_sum_ = device_loss_sum_.defined() ? device_loss_sum_ + here : here;
    }
    ++losses_;
  }
}

bool Agent::Impl::on_unscale(UnscaleBatch& batch) {
  const auto timed = agent_time();
  begin_cycle();
  const std::size_t n = batch.grads.size();
  if (stale_) stale_->unscaled(batch.params);
  views_.clear();
  ids_.clear();
  copies_.assign(n, at::Tensor());
  const at::Device scale_device = batch.found_inf.device();
  // Fused: every gradient read in place on the scale's device (torch then has nothing to do).
  bool fusable = options_.fused_unscale;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& g = batch.grads[i];
    const std::int64_t id = layer_of(batch.params[i]);
    if (batch.params[i].grad().is_sparse())
      session_.event_once("sparse:" + std::to_string(id), "sparse-gradient",
                          "layer " + std::to_string(id) + " has sparse gradients: statistics cover their stored values");
    if (!agent::directly_readable(g) || g.device() != scale_device) {
      fusable = false;
      session_.event_once("copied:" + std::to_string(id), "slow-path",
                          "layer " + std::to_string(id) + " has a " + agent::dtype_name(g.scalar_type()) + " " +
                              g.device().str() + (g.is_contiguous() ? "" : " non-contiguous") +
                              " gradient: its statistics are taken on a copy on its device and torch unscales it");
    }
    agent::DeviceTensor view;
    if (!agent::stats_view(g, copies_[i], view)) {
      fusable = false;
      continue;
    }
    ids_.push_back(id);
    views_.push_back(view);
  }
  agent::GradBatch b;
  b.layers = ids_.data();
  b.tensors = views_.data();
  b.count = views_.size();
  if (fusable) {
    // Same bits as torch's op; the statistics are those of the values before unscale.
    b.unscale = true;
    if (scale_device.is_cpu())
      b.inv_scale = batch.inv_scale.item<float>();  // a host tensor: no device wait
    else {
      b.device_inv_scale = batch.inv_scale.data_ptr<float>();
      b.device_found_inf = batch.found_inf.data_ptr<float>();
    }
  }
  const bool found = session_.grads(b);
  if (fusable && scale_device.is_cpu() && found) batch.found_inf.fill_(1.0);
  copies_.clear();
  return fusable;
}

namespace {

// A 0-dim tensor as a double on `device` (zero when undefined): device ops only.
at::Tensor as_double_on(const at::Tensor& t, const at::Device& device) {
  if (!t.defined()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  return t.to(device, at::kDouble, /*non_blocking=*/true).reshape({});
}

}  // namespace

void Agent::Impl::on_update(const ScaleUpdate& u) {
  const auto t0 = Clock::now();
  const at::Device device = u.scale_after.device();
  // update(new_scale) after the cycle's update(), e.g. to hold a minimum scale: the same
  // optimizer cycle, ending at this scale.
  const bool amend = !session_.checked();
  if (stale_ && !amend) {
    std::int64_t at = 0;
    if (const std::string detail = stale_->step_ended(at); !detail.empty())
      session_.event_once("gradients-not-zeroed", "gradients-not-zeroed", detail, at);
  }
  if (device.is_cpu()) {
    // Host tensors: read now, nothing to wait for.
    const double after = u.scale_after.item<double>();
    if (amend) {
      session_.amend_scale_after(after);
    } else {
      double loss = losses_ > 0 ? loss_sum_ : std::numeric_limits<double>::quiet_NaN();
      if (device_loss_sum_.defined()) loss = std::numeric_limits<double>::quiet_NaN();  // not read: a device loss
      const bool found = u.found_inf.defined() && u.found_inf.item<float>() != 0.0f;
      session_.end_step({loss, losses_, u.scale_before.item<double>(), after, found, skipped_}, ns_since(t0));
    }
  } else {
    // Device tensors: one small vector on the device, copied to the host without waiting;
    // the step is complete when it lands (a step or so later).
    agent::DeviceOutcome later;
    agent::session_device(device, later.device);
    later.stream = agent::current_stream(device);
    later.fields = agent::DeviceOutcome::kScaleAfter;
    if (!amend) {
      later.fields |= agent::DeviceOutcome::kScaleBefore | agent::DeviceOutcome::kFoundInf;
      if (device_loss_sum_.defined()) later.fields |= agent::DeviceOutcome::kLoss;
    }
    at::Tensor loss = as_double_on(device_loss_sum_, device);
    if (device_loss_sum_.defined() && loss_sum_ != 0.0) loss = loss + loss_sum_;
    const at::Tensor values =
        at::stack({loss, as_double_on(u.scale_before, device), as_double_on(u.scale_after, device),
                   as_double_on(u.found_inf, device)});
    later.values = values.data_ptr<double>();
    if (amend) {
      session_.amend_outcome(later);
    } else {
      const double nan = std::numeric_limits<double>::quiet_NaN();
      const double loss_now = device_loss_sum_.defined() ? nan : (losses_ > 0 ? loss_sum_ : nan);
      session_.end_step({loss_now, losses_, nan, nan, false, skipped_}, ns_since(t0), &later);
    }
  }
  if (amend) {
    session_.add_agent_ns(ns_since(t0));
    return;
  }
  replay_pins_.step_ended();
  skipped_ = false;
}

void Agent::Impl::training_raised(const std::exception& error) {
  if (closed_ || raised_) return;
  raised_ = true;
  session_.event("training-raised", agent::raised_text(error));
}

void Agent::Impl::close() {
  if (closed_) return;
  closed_ = true;
  if (scaler_ && scaler_->observer() == this) scaler_->set_observer(nullptr);
  for (auto& [param, handle] : hooks_) {
    try {
      param.remove_hook(handle);
    } catch (...) {
      // A parameter whose autograd meta is gone has no hook left to remove.
    }
  }
  hooks_.clear();
  last_output_ = at::Tensor();
  try {
    weight_norms_.flush();
  } catch (const std::exception& error) {
    session_.event_once("device-weights-flush", "warning",
                        std::string("the last device weights read were not recorded: ") + error.what());
  }
  half_updates_.flush();
  session_.close();
}

AgentStatus Agent::Impl::status() const {
  const auto c = session_.counters();
  return {db_path_, c.steps, c.rows_written, c.dropped, c.lost, c.write_errors, c.dropped_steps, c.first_error};
}

Agent::Agent(torch::nn::Module& model, GradScaler& scaler, AgentOptions options)
    : impl_(std::make_unique<Impl>(model, scaler, std::move(options))) {}

Agent::~Agent() = default;

at::Tensor Agent::probe(const std::string& module_path, const at::Tensor& x) { return impl_->probe(module_path, x); }

at::Tensor Agent::input(const std::string& name, const at::Tensor& x) { return impl_->input(name, x); }

at::Tensor Agent::forward_as(const std::string& module_path, const Forward& run, const Forward& replay,
                             const at::Tensor& x) {
  return impl_->forward_as(module_path, run, replay, x);
}

ModuleRange Agent::module_range(const std::string& module_path) {
  return ModuleRange(this, impl_->begin_module_range(module_path));
}

ModuleRange::~ModuleRange() {
  if (open_) agent_->impl_->end_range();
}

void Agent::training_raised(const std::exception& error) { impl_->training_raised(error); }

void Agent::close() { impl_->close(); }

AgentStatus Agent::status() const { return impl_->status(); }

}  // namespace ampdiag
