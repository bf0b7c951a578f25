// Trains a small regression for 30 steps with ampdiag::GradScaler and the agent attached,
// writing argv[1] (a run.db).
#include <torch/torch.h>

#include <cstdio>

#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: train RUN.db\n");
    return 2;
  }
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01));
  ampdiag::GradScaler scaler;
  ampdiag::AgentOptions options;
  options.db_path = argv[1];
  options.overwrite = true;
  ampdiag::Agent agent(*model, scaler, options);
  const auto w = torch::randn({16, 1});
  for (int step = 0; step < 30; ++step) {
    const auto x = torch::randn({8, 16});
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(model->forward(x), x.matmul(w));
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
  }
  agent.close();
  const auto status = agent.status();
  std::printf("%lld steps, %lld rows written to %s\n", (long long)status.steps, (long long)status.rows_written, argv[1]);
  return status.write_errors == 0 ? 0 : 1;
}
