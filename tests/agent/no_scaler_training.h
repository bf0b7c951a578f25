// A tiny training loop without a loss scaler (bf16 autocast unless told), for the agent
// made without one: loss() before each backward, step() in place of optimizer.step().
#pragma once

#include <torch/torch.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tiny_training.h"

namespace ampdiag::test {

struct NoScalerLoop {
  int steps = 6;
  std::string db;   // the agent's run.db; empty: no agent, optimizer.step() itself
  int micro = 1;    // losses a step (gradient accumulation)
  int nan_at = -1;  // the step whose losses are made NaN (-1: none)
  at::ScalarType dtype = at::kBFloat16;
  c10::Device device = c10::kCPU;
  // Wraps each step (may be empty): the CUDA tests run it with torch's sync debug mode set to error.
  std::function<void(const std::function<void()>&)> around;
};

// Trains TinyNet with SGD (momentum 0.9) on batches drawn on the loop's device; returns
// the parameters, on the host.
inline std::vector<torch::Tensor> train_without_scaler(const NoScalerLoop& loop) {
  torch::manual_seed(0);
  TinyNet net;
  net->to(loop.device);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::unique_ptr<Agent> agent = loop.db.empty() ? nullptr : std::make_unique<Agent>(*net, options_for(loop.db));
  const auto on_device = torch::TensorOptions().device(loop.device);
  for (int step = 0; step < loop.steps; ++step) {
    const auto run = [&] {
      optimizer.zero_grad();
      for (int k = 0; k < loop.micro; ++k) {
        const auto x = torch::randn({32, 16}, on_device), y = torch::randn({32, 1}, on_device);
        torch::Tensor loss;
        {
          HalfAutocast autocast(loop.device.type(), loop.dtype);
          auto h = torch::relu(net->a(x));
          if (agent) h = agent->probe("a", h);
          loss = torch::mse_loss(net->c(torch::relu(net->b(h))).to(torch::kFloat), y);
        }
        if (step == loop.nan_at) loss = loss * std::numeric_limits<float>::quiet_NaN();
        (agent ? agent->loss(loss) : loss).backward();
      }
      if (agent) agent->step(optimizer);
      else optimizer.step();
    };
    if (loop.around) loop.around(run);
    else run();
  }
  if (agent) agent->close();
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) params.push_back(p.detach().cpu().clone());
  return params;
}

}  // namespace ampdiag::test
