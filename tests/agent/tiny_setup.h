// The agent tests' usual fixture: the tiny net with SGD and a scaler, an Agent writing
// dir/run.db, a loop that runs a forward under autocast, and the run's events read back.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

namespace ampdiag::test {

// A tiny net, SGD and a scaler, seeded, with agent options writing dir/run.db.
struct TinySetup {
  TempDir dir;
  TinyNet net = (torch::manual_seed(0), TinyNet());
  torch::optim::SGD optimizer{net->parameters(), torch::optim::SGDOptions(0.01)};
  GradScaler scaler;
  AgentOptions options = options_for(dir.file("run.db"));
};

// `steps` steps of a loop with an agent on `t`: forward(agent, step) runs under autocast in
// `dtype` and returns the loss, which the scaler scales for backward, step and update.
inline void train_with_agent(TinySetup& t, int steps, at::ScalarType dtype,
                             const std::function<torch::Tensor(Agent&, int)>& forward) {
  Agent agent(*t.net, t.scaler, t.options);
  for (int step = 0; step < steps; ++step) {
    t.optimizer.zero_grad();
    torch::Tensor loss;
    {
      HalfAutocast autocast(c10::DeviceType::CPU, dtype);
      loss = forward(agent, step);
    }
    t.scaler.scale(loss).backward();
    t.scaler.step(t.optimizer);
    t.scaler.update();
  }
}

// The run's events of `kind`, as (step, detail).
inline std::vector<std::pair<std::int64_t, std::string>> events_of(const TinySetup& t, const std::string& kind) {
  std::vector<std::pair<std::int64_t, std::string>> events;
  for (const auto& e : rundb::RunDbReader(t.dir.file("run.db")).events())
    if (e.kind == kind) events.emplace_back(e.step, e.detail);
  return events;
}

}  // namespace ampdiag::test
