#include "weight_norms.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Type.h>
#include <torch/optim.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "session.h"
#include "tensor_views.h"

namespace ampdiag::agent {

namespace {

std::string setting(const char* key, double value) {
  char b[64];
  std::snprintf(b, sizeof b, " %s=%.6g", key, value);
  return b;
}

// The optimizer's class name without its namespace: torch::optim::AdamW -> "AdamW".
std::string class_name(const torch::optim::Optimizer& optimizer) {
  std::string name = c10::demangle(typeid(optimizer).name());
  const auto colon = name.rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

// The first parameter group's options, where their type carries them.
std::string group_settings(const torch::optim::OptimizerOptions& o) {
  using namespace torch::optim;
  if (const auto* a = dynamic_cast<const AdamWOptions*>(&o)) return setting("lr", a->lr()) + setting("weight_decay", a->weight_decay());
  if (const auto* a = dynamic_cast<const AdamOptions*>(&o)) return setting("lr", a->lr()) + setting("weight_decay", a->weight_decay());
  if (const auto* s = dynamic_cast<const SGDOptions*>(&o))
    return setting("lr", s->lr()) + setting("weight_decay", s->weight_decay()) + setting("momentum", s->momentum());
  if (const auto* r = dynamic_cast<const RMSpropOptions*>(&o))
    return setting("lr", r->lr()) + setting("weight_decay", r->weight_decay()) + setting("momentum", r->momentum());
  if (const auto* g = dynamic_cast<const AdagradOptions*>(&o)) return setting("lr", g->lr()) + setting("weight_decay", g->weight_decay());
  return setting("lr", o.get_lr());
}

constexpr double kLrMoved = 2.0;  // how far the learning rate must move to be recorded again

// The first group's learning rate; NaN without groups.
double first_lr(const torch::optim::Optimizer& optimizer) {
  const auto& groups = optimizer.param_groups();
  return groups.empty() ? std::numeric_limits<double>::quiet_NaN() : groups.front().options().get_lr();
}

// Whether it moved kLrMoved times or more since `said` (from 0, any rise).
bool lr_moved(double said, double now) {
  if (!std::isfinite(said) || !std::isfinite(now)) return false;
  return said > 0.0 ? now >= said * kLrMoved || now * kLrMoved <= said : now > 0.0;
}

// The L2 norm (in float64, whose squares cannot overflow) and abs-max (exact in the tensor's
// dtype) of each tensor, as [n, 2] float64 on their device: two foreach launches. An empty
// tensor's are 0 (torch's foreach infinity norm raises for one: it has no identity).
at::Tensor norms_of(std::vector<at::Tensor> params) {
  for (auto& p : params)
    if (p.numel() == 0) p = at::zeros({1}, p.options());
  return at::stack({at::stack(at::_foreach_norm(params, 2, at::kDouble)),
                    at::stack(at::_foreach_norm(params, std::numeric_limits<double>::infinity())).to(at::kDouble)},
                   1);
}

}  // namespace

std::string optimizer_settings(const torch::optim::Optimizer& optimizer) {
  const auto& groups = optimizer.param_groups();
  std::string said = class_name(optimizer);
  if (groups.empty()) return said;
  said += group_settings(groups.front().options());
  if (groups.size() > 1) said += " (first of " + std::to_string(groups.size()) + " groups)";
  return said;
}

void WeightNorms::add(std::int64_t layer, const at::Tensor& param) {
  if (!param.is_floating_point() || param.is_sparse()) return;
  if (param.device().is_cpu())
    params_.emplace_back(layer, param);
  else if (param.device().is_cuda())
    device_params_.emplace_back(layer, param);
}

void WeightNorms::optimizer_starting(const torch::optim::Optimizer& optimizer) {
  reads_.poll(false);
  const auto [said, first] = described_.try_emplace(&optimizer, first_lr(optimizer));
  if (first) session_.event("optimizer-settings", optimizer_settings(optimizer));
  if (!schedule_.at_start(session_.step())) return;
  read();
  // A learning-rate schedule moved it: the rate the weights grow under is the one to quote.
  if (const double now = first_lr(optimizer); !first && lr_moved(said->second, now)) {
    said->second = now;
    session_.event("optimizer-settings", optimizer_settings(optimizer));
  }
}

void WeightNorms::step_skipped() {
  reads_.poll(false);
  const std::int64_t step = session_.step();
  // A skipped step on the schedule was not read before an optimizer step: it had none.
  const bool due = schedule_.at_start(step);
  if (schedule_.after_skip(step) || due) read();
}

void WeightNorms::read() {
  at::NoGradGuard no_grad;
  if (!device_params_.empty()) {
    try {
      read_devices();
    } catch (const std::exception& error) {  // reading the weights must never stop the training
      device_params_.clear();
      session_.event_once("device-weights", "warning",
                          std::string("the weights on devices are not read: ") + error.what());
    }
  }
  // float32/float16/bfloat16 blocks in one pass of the engine (Session::weight_norms);
  // the rest (float64, gaps) through torch's foreach norms, as device weights are.
  std::vector<std::int64_t> layers, other_layers;
  std::vector<kernels::TensorRef> refs;
  std::vector<at::Tensor> others;
  for (const auto& [layer, param] : params_) {
    const at::Tensor w = param.detach();
    DeviceTensor view;
    at::Tensor unused;
    if (directly_readable(w) && stats_view(w, unused, view)) {
      layers.push_back(layer);
      refs.push_back(view.ref);
      continue;
    }
    other_layers.push_back(layer);
    others.push_back(w);
  }
  session_.weight_norms(layers.data(), refs.data(), refs.size());
  if (!others.empty()) reads_.send(session_.step(), std::move(other_layers), norms_of(others));
}

void WeightNorms::read_devices() {
  // Per device, in the order the parameters came.
  std::vector<at::Device> devices;
  for (const auto& [layer, param] : device_params_)
    if (std::find(devices.begin(), devices.end(), param.device()) == devices.end()) devices.push_back(param.device());
  for (const auto& device : devices) {
    std::vector<std::int64_t> layers;
    std::vector<at::Tensor> params;
    for (const auto& [layer, param] : device_params_)
      if (param.device() == device) {
        layers.push_back(layer);
        params.push_back(param.detach());
      }
    reads_.send(session_.step(), std::move(layers), norms_of(params));
  }
}

void WeightNorms::post(std::int64_t step, const std::vector<std::int64_t>& layers, const at::Tensor& values) {
  const double* v = values.data_ptr<double>();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const double l2 = v[2 * i], peak = v[2 * i + 1];  // a tensor holding NaN/Inf has no row
    if (std::isfinite(l2) && std::isfinite(peak)) session_.weight_norm(layers[i], l2, std::min(peak, l2), step);
  }
}

void WeightNorms::flush() { reads_.poll(true); }

}  // namespace ampdiag::agent
