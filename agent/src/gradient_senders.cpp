#include "gradient_senders.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/isfinite.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>

namespace ampdiag::agent {

namespace {

bool holds_nonfinite(const at::Tensor& grad) { return !at::isfinite(grad).all().item<bool>(); }

}  // namespace

GradientSenders::GradientSenders() = default;
GradientSenders::~GradientSenders() = default;

void GradientSenders::output(const std::string& path, const at::Tensor& y) {
  if (!core_.armed() || path != core_.target() || !y.defined() || !y.grad_fn() || !at::GradMode::is_enabled())
    return;
  made_.push_back(y.grad_fn());
}

bool GradientSenders::made_from(const Node* node) const {
  for (int hop = 0; hop < kTraceHops && node != nullptr; ++hop) {
    if (std::any_of(made_.begin(), made_.end(), [&](const auto& made) { return made.get() == node; })) return true;
    // Only operations whose one input that is not a parameter is the one before.
    const Node* before = nullptr;
    int inputs = 0;
    for (const auto& edge : node->next_edges()) {
      if (!edge.function || edge.function->name() == "torch::autograd::AccumulateGrad") continue;
      before = edge.function.get();
      ++inputs;
    }
    if (inputs != 1) return false;
    node = before;
  }
  return false;
}

at::Tensor GradientSenders::input(const std::string& path, const at::Tensor& x) {
  if (made_.empty() || !core_.user(path) || !x.defined() || !x.device().is_cpu() || !x.grad_fn() ||
      !at::GradMode::is_enabled() || !made_from(x.grad_fn().get())) {
    pending_.push_back(nullptr);  // (a module around a user returns before it)
    return x;
  }
  auto call = std::make_shared<Call>();
  call->path = path;
  calls_.push_back(call);
  pending_.push_back(call);
  // Its own node: what this call's backward sends back arrives here, apart from the others'.
  at::Tensor given = x.view_as(x);
  std::shared_ptr<std::atomic<int>> sends = sends_;
  given.register_hook([call, sends](const at::Tensor& grad) {
    if (call->sent.load() < 0 && grad.defined() && grad.device().is_cpu() && holds_nonfinite(grad))
      call->sent.store(sends->fetch_add(1));
  });
  return given;
}

void GradientSenders::returned(const at::Tensor& y) {
  if (pending_.empty()) return;
  std::shared_ptr<Call> call = std::move(pending_.back());
  pending_.pop_back();
  if (!call || !y.defined() || !y.requires_grad() || !y.grad_fn()) return;
  y.register_hook([call](const at::Tensor& grad) {
    if (call->received.load() == 1 || !grad.defined() || !grad.device().is_cpu()) return;
    call->received.store(holds_nonfinite(grad) ? 1 : 0);
  });
}

std::string GradientSenders::step_ended(const std::string& named) {
  std::vector<SenderWatch::Call> calls;
  for (const auto& c : calls_) calls.push_back({c->path, c->received.load(), c->sent.load()});
  calls_.clear();
  made_.clear();
  pending_.clear();
  sends_ = std::make_shared<std::atomic<int>>(0);  // hooks still pending from this step count apart
  return core_.step_ended(named, calls);
}

}  // namespace ampdiag::agent
