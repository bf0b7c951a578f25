// A LibTorch model trained with bf16 parameters (model->to(kBFloat16), no FP32 master
// weights; the scaler, like torch's, refuses fp16 parameters' gradients), with the agent
// or with a direct comparison of each step's weights before and after the optimizer's step:
// shared by the host test and the CUDA one.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"
#include "ampdiag/rundb/reader.h"

namespace ampdiag::test {

// "step layer nonzero stalled": strings, so that Catch prints a mismatch.
using UpdateRow = std::string;
inline UpdateRow update_row(std::int64_t step, std::int64_t layer, std::int64_t nonzero, std::int64_t stalled) {
  return std::to_string(step) + " " + std::to_string(layer) + " " + std::to_string(nonzero) + " " + std::to_string(stalled);
}

constexpr std::int64_t kHalfEvery = 4;  // the agent's sampling in train_half

// Trains 9 steps on `device`, the agent (sampling every kHalfEvery) writing `db`; `db`
// empty: without the agent, counting each step directly into `direct` instead. At scale 1
// the scaler changes no bit, so `scaler_enabled` false trains the same: torch's CUDA
// unscale has no bf16 kernel ("not implemented for 'BFloat16'", torch 2.11 on an H200), and
// only the agent's fused unscale takes bf16 gradients there. Returns the parameters, on
// the host.
inline std::vector<torch::Tensor> train_half(const std::string& db, std::vector<UpdateRow>* direct,
                                             c10::Device device = c10::kCPU, bool scaler_enabled = true) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  model->to(device, torch::kBFloat16);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  GradScalerOptions so;
  so.init_scale = 1.0;  // the scaler must not skip a step: every step is compared
  so.enabled = scaler_enabled;
  GradScaler scaler(so);
  const auto x = torch::randn({128, 32}).to(device, torch::kBFloat16);
  const auto y = torch::randn({128, 1}).to(device);
  std::unique_ptr<Agent> agent;
  if (!db.empty()) {
    AgentOptions o;
    o.db_path = db;
    o.every = kHalfEvery;
    agent = std::make_unique<Agent>(*model, scaler, o);
  }
  for (std::int64_t step = 0; step < 9; ++step) {
    opt.zero_grad();
    scaler.scale(torch::mse_loss(model->forward(x).to(torch::kFloat), y)).backward();
    std::vector<std::pair<torch::Tensor, torch::Tensor>> before;
    if (direct)
      for (const auto& p : model->parameters()) before.emplace_back(p.detach().clone(), p.grad().clone());
    if (!scaler.step(opt)) throw std::logic_error("train_half: the scaler skipped a step");
    scaler.update();
    if (!direct) continue;
    const auto params = model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto moved = torch::isfinite(before[i].second) & (before[i].second != 0);
      direct->push_back(update_row(step, std::int64_t(i), moved.sum().item<std::int64_t>(),
                                   (moved & (params[i].detach() == before[i].first)).sum().item<std::int64_t>()));
    }
  }
  agent.reset();
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().cpu().clone());
  return out;
}

// The run.db's weight_updates rows.
inline std::vector<UpdateRow> recorded_updates(const std::string& db) {
  std::vector<UpdateRow> recorded;
  for (const auto& r : rundb::RunDbReader(db).weight_updates()) recorded.push_back(update_row(r.step, r.layer_id, r.nonzero, r.stalled));
  return recorded;
}

// The direct rows of the steps the agent samples.
inline std::vector<UpdateRow> sampled(const std::vector<UpdateRow>& direct) {
  std::vector<UpdateRow> out;
  for (const auto& r : direct)
    if (std::stoll(r) % kHalfEvery == 0) out.push_back(r);
  return out;
}

// Whether some row's update stalled in most of its elements: the case is a real one.
inline bool mostly_stalled(const std::vector<UpdateRow>& rows) {
  for (const auto& r : rows) {
    std::int64_t step = 0, layer = 0, nonzero = 0, stalled = 0;
    std::istringstream(r) >> step >> layer >> nonzero >> stalled;
    if (stalled * 2 > nonzero) return true;
  }
  return false;
}

}  // namespace ampdiag::test
