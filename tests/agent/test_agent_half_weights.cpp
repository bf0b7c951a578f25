// A LibTorch model trained with bf16 parameters (model->to(kBFloat16), no FP32 master
// weights; the scaler, like torch's, refuses fp16 parameters' gradients) under the agent: the stalled updates it records are a direct comparison's counts on the sampled
// steps, and the training is bit-identical with and without it.
#include "../catch_with_torch.h"

#include <torch/torch.h>

#include <string>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"
#include "ampdiag/rundb/reader.h"

using namespace ampdiag;
using ampdiag::test::TempDir;

namespace {

// "step layer nonzero stalled": strings, so that Catch prints a mismatch.
using Row = std::string;
Row row(std::int64_t step, std::int64_t layer, std::int64_t nonzero, std::int64_t stalled) {
  return std::to_string(step) + " " + std::to_string(layer) + " " + std::to_string(nonzero) + " " + std::to_string(stalled);
}

// Trains 9 steps; `db` empty: without the agent, counting each step directly instead.
std::vector<torch::Tensor> train(const std::string& db, std::vector<Row>* direct) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  model->to(torch::kBFloat16);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  GradScalerOptions so;
  so.init_scale = 1.0;  // the scaler must not skip a step: every step is compared
  GradScaler scaler(so);
  const auto x = torch::randn({128, 32}).to(torch::kBFloat16);
  const auto y = torch::randn({128, 1});
  std::unique_ptr<Agent> agent;
  if (!db.empty()) {
    AgentOptions o;
    o.db_path = db;
    o.every = 4;
    agent = std::make_unique<Agent>(*model, scaler, o);
  }
  for (std::int64_t step = 0; step < 9; ++step) {
    opt.zero_grad();
    scaler.scale(torch::mse_loss(model->forward(x).to(torch::kFloat), y)).backward();
    std::vector<std::pair<torch::Tensor, torch::Tensor>> before;
    if (direct)
      for (const auto& p : model->parameters()) before.emplace_back(p.detach().clone(), p.grad().clone());
    REQUIRE(scaler.step(opt));
    scaler.update();
    if (!direct) continue;
    const auto params = model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto moved = torch::isfinite(before[i].second) & (before[i].second != 0);
      direct->push_back(row(step, std::int64_t(i), moved.sum().item<std::int64_t>(),
                            (moved & (params[i].detach() == before[i].first)).sum().item<std::int64_t>()));
    }
  }
  agent.reset();
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("the C++ agent's stalled-update counts are a direct comparison's on the sampled steps", "[agent][weights]") {
  TempDir dir;
  std::vector<Row> direct;
  const auto plain = train("", &direct);
  const auto watched = train(dir.file("half.db"), nullptr);
  REQUIRE(plain.size() == watched.size());
  for (std::size_t i = 0; i < plain.size(); ++i) REQUIRE(torch::equal(plain[i], watched[i]));
  std::vector<Row> recorded;
  bool mostly_stalled = false;  // the case is a real one
  for (const auto& r : rundb::RunDbReader(dir.file("half.db")).weight_updates()) {
    recorded.push_back(row(r.step, r.layer_id, r.nonzero, r.stalled));
    mostly_stalled = mostly_stalled || r.stalled * 2 > r.nonzero;
  }
  std::vector<Row> expected;
  for (const auto& r : direct)
    if (std::stoll(r) % 4 == 0) expected.push_back(r);
  REQUIRE(recorded == expected);
  REQUIRE(mostly_stalled);
}
