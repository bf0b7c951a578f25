// GradScaler: a port of torch/amp/grad_scaler.py. It calls the same ATen ops
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_) so its numbers are
// torch's; tests compare its trajectory with the Python scaler's.
#include "ampdiag/grad_scaler.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace ampdiag {

namespace {

// Adds each found_inf, moved without blocking to `device`, into `sum` (undefined: none yet).
void add_found_infs(at::Tensor& sum, const std::vector<at::Tensor>& found_infs, const at::Device& device) {
  for (const auto& f : found_infs) {
    const at::Tensor here = f.to(device, /*non_blocking=*/true);
    sum = sum.defined() ? sum + here : here;
  }
}

}  // namespace

GradScaler::GradScaler(const GradScalerOptions& o)
    : enabled_(o.enabled),
      init_scale_(o.init_scale),
      growth_factor_(o.growth_factor),
      backoff_factor_(o.backoff_factor),
      growth_interval_(o.growth_interval) {
  if (!enabled_) return;
  if (!(o.growth_factor > 1.0)) throw std::invalid_argument("GradScaler: the growth factor must be > 1.0");
  if (!(o.backoff_factor < 1.0)) throw std::invalid_argument("GradScaler: the backoff factor must be < 1.0");
  if (!(o.init_scale > 0.0)) throw std::invalid_argument("GradScaler: init_scale must be > 0");
  if (o.growth_interval < 1) throw std::invalid_argument("GradScaler: growth_interval must be >= 1");
}

void GradScaler::check_initialized(const char* function) const {
  if (!scale_.defined())
    throw std::logic_error(std::string("GradScaler: attempted ") + function +
                           " but the scale is not set: call scaler.scale(loss) earlier in the iteration");
}

void GradScaler::lazy_init(const at::Device& device) {
  scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::full({}, init_growth_tracker_, at::TensorOptions().dtype(at::kInt).device(device));
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) return outputs;
  if (!outputs.defined()) throw std::invalid_argument("GradScaler::scale: outputs is an undefined tensor");
  if (!scale_.defined()) lazy_init(outputs.device());
  if (observer_) observer_->on_scale(outputs);
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::unscale_grads(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale,
                                                  const at::Tensor& found_inf) {
  c10::AutoGradMode no_grad(false);
  UnscaleBatch batch;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      at::Tensor grad = param.mutable_grad();
      if (!grad.defined()) continue;
      if (grad.scalar_type() == at::kHalf)
        throw std::invalid_argument("GradScaler: Attempting to unscale FP16 gradients (keep fp32 master parameters)");
      if (grad.is_sparse()) grad = grad._values();  // torch checks and unscales the stored values
      batch.params.push_back(param);
      batch.grads.push_back(grad);
    }
  }
  if (found_inf.device() != scale_.device()) throw std::logic_error("GradScaler: found_inf on the wrong device");
  batch.found_inf = found_inf;
  batch.inv_scale = inv_scale;
  const bool handled = observer_ && observer_->on_unscale(batch);
  // torch groups by device and dtype: one found_inf per device, one op per group.
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
  std::map<std::string, at::Tensor> found_inf_per_device;
  for (const auto& g : batch.grads) {
    const std::string device = g.device().str();
    groups[{device, int(g.scalar_type())}].push_back(g);
    if (!found_inf_per_device.count(device))
      found_inf_per_device[device] = g.device() == found_inf.device() ? found_inf : at::zeros_like(found_inf, found_inf.options().device(g.device()));
  }
  if (!handled) {
    for (auto& [key, grads] : groups) {
      at::Tensor& device_found_inf = found_inf_per_device[key.first];
      at::_amp_foreach_non_finite_check_and_unscale_(grads, device_found_inf,
                                                     inv_scale.to(grads.front().device(), /*non_blocking=*/true));
    }
  }
  std::vector<at::Tensor> out;
  for (auto& [device, t] : found_inf_per_device) out.push_back(t);
  return out;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return;
  check_initialized("unscale_");
  OptimizerState& state = per_optimizer_[&optimizer];
  if (state.stage == Stage::kUnscaled)
    throw std::logic_error("GradScaler: unscale_() has already been called on this optimizer since the last update()");
  if (state.stage == Stage::kStepped) throw std::logic_error("GradScaler: unscale_() is being called after step()");
  // The reciprocal in fp64, as torch does: fp32 division can be imprecise.
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  const at::Tensor found_inf = at::full({}, 0.0, at::TensorOptions().dtype(at::kFloat).device(scale_.device()));
  state.found_inf_per_device = unscale_grads(optimizer, inv_scale, found_inf);
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    last_step_skipped_ = false;
    if (observer_) observer_->on_step(false);
    return true;
  }
  check_initialized("step");
  if (per_optimizer_[&optimizer].stage == Stage::kStepped)
    throw std::logic_error("GradScaler: step() has already been called since the last update()");
  if (per_optimizer_[&optimizer].stage == Stage::kReady) unscale_(optimizer);
  OptimizerState& state = per_optimizer_[&optimizer];
  // The one read of the device in a scaler cycle, as in torch: whether to run a
  // (non-fused) optimizer is a host decision.
  at::Tensor any_inf;
  add_found_infs(any_inf, state.found_inf_per_device, scale_.device());
  const bool found_inf = any_inf.defined() && any_inf.item<float>() != 0.0f;
  if (!found_inf) {
    if (observer_) observer_->on_optimizer(optimizer, true);
    optimizer.step();
    if (observer_) observer_->on_optimizer(optimizer, false);
  }
  state.stage = Stage::kStepped;
  last_step_skipped_ = found_inf;
  if (observer_) observer_->on_step(found_inf);
  return !found_inf;
}

at::Tensor GradScaler::combined_found_inf() const {
  at::Tensor combined;
  for (const auto& [opt, state] : per_optimizer_) add_found_infs(combined, state.found_inf_per_device, scale_.device());
  return combined;
}

void GradScaler::notify_update(const at::Tensor& scale_before, const at::Tensor& found_inf) {
  if (observer_) observer_->on_update({scale_before, scale_.clone(), found_inf});
}

void GradScaler::update() {
  if (!enabled_) return;
  check_initialized("update");
  const at::Tensor found_inf = combined_found_inf();
  if (!found_inf.defined()) throw std::logic_error("GradScaler: no inf checks were recorded prior to update()");
  const at::Tensor before = observer_ ? scale_.clone() : at::Tensor();
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf, growth_factor_, backoff_factor_, growth_interval_);
  per_optimizer_.clear();
  notify_update(before, found_inf);
}

void GradScaler::update(double new_scale) {
  if (!enabled_) return;
  check_initialized("update");
  if (!(new_scale > 0.0) || !std::isfinite(new_scale))
    throw std::invalid_argument("GradScaler::update: new_scale must be a finite number > 0, not " +
                                std::to_string(new_scale));
  const at::Tensor found_inf = observer_ ? combined_found_inf() : at::Tensor();
  const at::Tensor before = observer_ ? scale_.clone() : at::Tensor();
  scale_.fill_(new_scale);
  per_optimizer_.clear();
  notify_update(before, found_inf);
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

std::int64_t GradScaler::growth_tracker() const {
  if (!enabled_) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<std::int32_t>() : init_growth_tracker_;
}

GradScalerState GradScaler::state_dict() const {
  return {get_scale(), growth_factor_, backoff_factor_, growth_interval_, growth_tracker()};
}

void GradScaler::load_state_dict(const GradScalerState& s) {
  if (!enabled_) return;
  if (!(s.growth_factor > 1.0) || !(s.backoff_factor < 1.0) || s.growth_interval < 1 || !(s.scale > 0.0))
    throw std::invalid_argument("GradScaler::load_state_dict: state out of range (growth_factor > 1, "
                                "backoff_factor < 1, growth_interval >= 1, scale > 0)");
  init_scale_ = s.scale;
  if (scale_.defined()) scale_.fill_(s.scale);
  growth_factor_ = s.growth_factor;
  backoff_factor_ = s.backoff_factor;
  growth_interval_ = s.growth_interval;
  init_growth_tracker_ = s.growth_tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(s.growth_tracker);
}

}  // namespace ampdiag
