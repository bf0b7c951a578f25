// A tiny fp16-autocast training loop for the agent tests, with optional agent and an
// initial loss scale high enough that the first steps overflow and are skipped.
#pragma once

#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <functional>
#include <vector>

#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"

namespace ampdiag::test {

struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    a = register_module("a", torch::nn::Linear(16, 32));
    b = register_module("b", torch::nn::Linear(32, 32));
    c = register_module("c", torch::nn::Linear(32, 1));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(TinyNet);

struct CpuHalfAutocast {
  CpuHalfAutocast() {
    at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::increment_nesting();
  }
  ~CpuHalfAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, false);
  }
};

struct TrainResult {
  std::vector<torch::Tensor> params;
  std::int64_t skipped = 0;
};

// Trains `steps` steps; `make_agent` (may be empty) attaches an agent to the model and
// scaler and returns it; `probe` lets the forward call agent.probe.
inline TrainResult train_tiny(std::int64_t steps,
                              const std::function<std::unique_ptr<Agent>(TinyNet&, GradScaler&)>& make_agent) {
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  GradScalerOptions options;
  options.init_scale = 1e9;  // far too high: the first steps overflow in fp16 and are skipped
  options.growth_interval = 4;
  GradScaler scaler(options);
  std::unique_ptr<Agent> agent = make_agent ? make_agent(net, scaler) : nullptr;
  const auto x = torch::randn({64, 16});
  const auto y = torch::randn({64, 1});
  TrainResult result;
  for (std::int64_t step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      CpuHalfAutocast autocast;
      auto h = torch::relu(net->a(x));
      if (agent) h = agent->probe("a", h);
      h = torch::relu(net->b(h));
      if (agent) h = agent->probe("b", h);
      loss = torch::mse_loss(net->c(h).to(torch::kFloat), y);
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
    result.skipped += scaler.last_step_skipped() ? 1 : 0;
  }
  if (agent) agent->close();
  for (const auto& p : net->parameters()) result.params.push_back(p.detach().clone());
  return result;
}

inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.view(torch::kInt).equal(b.view(torch::kInt));
}

}  // namespace ampdiag::test
