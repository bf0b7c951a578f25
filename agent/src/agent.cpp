// Agent: attaches to a model and a GradScaler, stages each step's statistics, decides
// what to record at update() and hands fixed-size records to the writer thread (the
// Impl's class: agent_impl.h; its forward side: agent_forward.cpp; without a scaler:
// agent_without_scaler.cpp).
#include "ampdiag/agent.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/nn/module.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <memory>
#include <set>
#include <stdexcept>

#include "ampdiag/grad_scaler.h"
#include "agent_impl.h"
#include "agent_setup.h"
#include "autocast_state.h"
#include "gradient_graph.h"
#include "run_paths.h"

namespace ampdiag {

using agent::Clock;
using agent::ns_since;

namespace {

std::uintptr_t key_of(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.unsafeGetTensorImpl()); }

}  // namespace

Agent::Impl::Impl(torch::nn::Module& model, GradScaler* scaler, AgentOptions options)
    : options_(std::move(options)),
      scaler_(scaler),
      session_(agent::session_options(options_)),
      replay_pins_(session_, options_.replay, options_.autopin),
      checks_(session_, options_.precision_budget),
      batch_(session_) {
  if (options_.autopin < 0) throw std::invalid_argument("AgentOptions.autopin must be >= 0 (0: never pin)");
  if (options_.autopin > 0 && !options_.replay)
    throw std::invalid_argument("AgentOptions.autopin needs replay: it pins only what an FP32 replay confirmed");
  if (scaler && !scaler->is_enabled())
    throw std::invalid_argument(
        "ampdiag::Agent: the GradScaler is disabled, so there is no loss scale to watch; enable it (fp16), or "
        "make the Agent without it (bf16, or AMP off): ampdiag::Agent agent(model, options), then "
        "agent.loss(loss) before each backward and agent.step(optimizer) instead of optimizer.step()");
  if (scaler && scaler->observer())
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
  // Without a scaler the guess is bf16 (fp16 needs one); the first training probe corrects it.
  meta.amp_dtype = !options_.amp_dtype.empty() ? options_.amp_dtype : scaler ? "float16" : "bfloat16";
  learn_amp_dtype_ = options_.amp_dtype.empty();
  meta.command_line = agent::command_line();
  meta.fused_unscale = options_.fused_unscale;
  meta.has_scaler = scaler != nullptr;
  if (scaler) {
    meta.scaler_init_scale = scaler->get_scale();
    meta.scaler_growth_factor = scaler->get_growth_factor();
    meta.scaler_backoff_factor = scaler->get_backoff_factor();
    meta.scaler_growth_interval = scaler->get_growth_interval();
  }
  session_.write_meta(meta);
  // The analyzer offers no pin that the run already had (set: each path once).
  for (const auto& path : std::set<std::string>(options_.pinned_fp32.begin(), options_.pinned_fp32.end()))
    session_.event("pinned-fp32", path);
  if (scaler) scaler->set_observer(this);
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
  std::atomic<int>* task = &backward_task_;
  const std::int64_t id = layer.id;
  hooks_.emplace_back(p, p.register_hook([session, task, id](const at::Tensor&) {
    // A backward of its own (a second loss's) orders the layers it reaches anew: the loop's
    // backward() calls are not the agent's to see, their graph tasks are.
    const int now = torch::autograd::get_current_graph_task_id();
    if (task->exchange(now, std::memory_order_relaxed) != now) session->backward_began();
    session->arrived(id);
  }));
  return layer;
}

void Agent::Impl::register_layers(torch::nn::Module& model) {
  model_ = model.weak_from_this();
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    module_types_[item.key()] = agent::module_type_name(*item.value());
    // torch's own leaves are one operation, which their type names: no code of theirs to read.
    if (item.value()->name().rfind("torch::nn::", 0) == 0 && item.value()->children().empty())
      torch_leaves_.insert(item.key());
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) register_parameter(item.key(), item.value());
  if (options_.replay) entries_.own_parameters(model.named_parameters(/*recurse=*/false).pairs());
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

bool Agent::Impl::begin_module_range(const std::string& path) {
  if (closed_ || !session_.profiling()) return false;
  begin_cycle();
  const std::int64_t module = session_.module_id(path, module_type(path), "", "");
  // Autocast's dtype where it is on (the kernels of a module under autocast mostly run in
  // it), else fp32; kernel names decide where they say.
  rundb::GpuKind hint = rundb::GpuKind::kFloat32;
  if (agent::autocast_enabled(at::kCUDA))
    hint = agent::autocast_dtype(at::kCUDA) == at::kBFloat16 ? rundb::GpuKind::kBFloat16 : rundb::GpuKind::kFloat16;
  return session_.begin_range(module, rundb::GpuPhase::kForward, hint);
}

void Agent::Impl::begin_cycle() {
  if (!session_.begin_cycle()) return;
  if (stale_) stale_->cycle_began();
  replay_pins_.announce();
  checks_.step_began();
  nonfinite_seen_ = false;
  last_output_ = at::Tensor();  // held no longer than its cycle
  step_outputs_.clear();
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
  if (scaler_ && outputs.scalar_type() == at::kHalf)  // without a scaler no scale is multiplied in
    session_.event_once("half-loss", "half-loss", "scaler.scale() received a float16 loss");
  bool host_nonfinite = false;
  if (outputs.numel() == 1 && at::isFloatingType(outputs.scalar_type())) {
    const at::Tensor loss = outputs.detach().reshape({}).to(at::kDouble);
    if (outputs.device().is_cpu()) {
      const double value = loss.item<double>();
      host_nonfinite = !std::isfinite(value);
      loss_sum_ += value;
    } else {
      const at::Tensor here = device_loss_sum_.defined() ? loss.to(device_loss_sum_.device(), /*non_blocking=*/true) : loss;
      device_loss_sum_ = device_loss_sum_.defined() ? device_loss_sum_ + here : here;
    }
    ++losses_;
  }
  // The loss code made the NaN/Inf only where no probed output nor parameter held it first.
  if (options_.replay) entries_.loss(outputs, host_nonfinite && !nonfinite_seen_ && !parameters_nonfinite_);
  if (!fp32_gradients_read_ && outputs.grad_fn()) {
    fp32_gradients_read_ = true;
    if (const auto graph = agent::gradient_graph(outputs, named_params_))
      if (const std::string detail = agent::fp32_gradients_detail(agent::fp32_gradient_params(*graph)); !detail.empty())
        session_.event_once(agent::kFp32GradientsKind, agent::kFp32GradientsKind, detail);
  }
}

bool Agent::Impl::gradient_views(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                 const at::Device* scale_device) {
  const std::size_t n = grads.size();
  views_.clear();
  ids_.clear();
  copies_.assign(n, at::Tensor());
  // Fused: every gradient read in place on the scale's device (torch then has nothing to do).
  bool fusable = scale_device != nullptr && options_.fused_unscale;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    const std::int64_t id = layer_of(params[i]);
    if (params[i].grad().is_sparse())
      session_.event_once("sparse:" + std::to_string(id), "sparse-gradient",
                          "layer " + std::to_string(id) + " has sparse gradients: statistics cover their stored values");
    if (scale_device && (!agent::directly_readable(g) || g.device() != *scale_device)) {
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
  return fusable;
}

bool Agent::Impl::on_unscale(UnscaleBatch& batch) {
  const auto timed = agent_time();
  begin_cycle();
  if (stale_) stale_->unscaled(batch.params);
  const at::Device scale_device = batch.found_inf.device();
  const bool fusable = gradient_views(batch.params, batch.grads, &scale_device);
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
      if (options_.replay) {
        // A step whose forward, parameters or loss already held NaN/Inf is the forward's: it judges nothing.
        const bool judge = skipped_ && (losses_ == 0 || std::isfinite(loss)) && !nonfinite_seen_ && !parameters_nonfinite_;
        const std::vector<std::string> others =
            judge ? session_.nonfinite_modules(agent::EntryWatches::kCompanions) : std::vector<std::string>{};
        for (const auto& e : entries_.step_ended(judge ? session_.origin_module() : "", others))
          session_.event(e.kind, e.detail);
      }
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
  raised_in();
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
    : impl_(std::make_unique<Impl>(model, &scaler, std::move(options))) {}

Agent::Agent(torch::nn::Module& model, AgentOptions options)
    : impl_(std::make_unique<Impl>(model, nullptr, std::move(options))) {}

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

at::Tensor Agent::loss(const at::Tensor& loss) { return impl_->loss(loss); }

void Agent::step(torch::optim::Optimizer& optimizer) { impl_->step(optimizer); }

void Agent::close() { impl_->close(); }

AgentStatus Agent::status() const { return impl_->status(); }

}  // namespace ampdiag
