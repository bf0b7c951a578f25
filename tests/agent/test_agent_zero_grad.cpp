// Gradients not zeroed between optimizer steps, in a LibTorch loop: the C++ agent records
// event "gradients-not-zeroed" once, at the first step whose probe parameter (the smallest
// trainable host one) still held the previous step's gradient, as the Python agent does; the
// zeroing loops record none (the report's rule is tested in tests/analyzer).
#include "../catch_with_torch.h"

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

// `steps` fp16 steps of TinyNet with an agent; `zero(optimizer)` starts each step and
// `micro` backwards make it. Returns the steps and details of the run's
// gradients-not-zeroed events.
std::vector<std::pair<std::int64_t, std::string>> stale_events(const std::string& db,
                                                               const std::function<void(torch::optim::SGD&)>& zero,
                                                               int steps = 4, int micro = 1) {
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(1e-3));
  GradScalerOptions options;
  options.init_scale = 1024;
  GradScaler scaler(options);
  AgentOptions agent_options;
  agent_options.db_path = db;
  Agent agent(*net, scaler, agent_options);
  const auto x = torch::randn({16, 16}), y = torch::randn({16, 1});
  for (int step = 0; step < steps; ++step) {
    zero(optimizer);
    for (int k = 0; k < micro; ++k) {
      torch::Tensor loss;
      {
        HalfAutocast autocast;
        loss = torch::mse_loss(net->c(torch::relu(net->b(torch::relu(net->a(x))))).to(torch::kFloat), y) / micro;
      }
      scaler.scale(loss).backward();
    }
    scaler.step(optimizer);
    scaler.update();
  }
  agent.close();
  std::vector<std::pair<std::int64_t, std::string>> found;
  for (const auto& e : rundb::RunDbReader(db).events())
    if (e.kind == "gradients-not-zeroed") found.emplace_back(e.step, e.detail);
  return found;
}

}  // namespace

TEST_CASE("a LibTorch loop that never zeroes its gradients is recorded at its second step", "[agent][zero-grad]") {
  TempDir dir;
  const auto events = stale_events(dir.file("run.db"), [](torch::optim::SGD&) {});
  REQUIRE(events.size() == 1);
  CHECK(events[0].first == 1);
  CHECK(events[0].second == "c.bias's gradient still held the previous optimizer step's values when this step's first "
                            "gradient arrived: the gradients were not zeroed between steps");
}

TEST_CASE("zeroing the gradients each step, or accumulating micro-batches within one, records nothing",
          "[agent][zero-grad]") {
  TempDir dir;
  CHECK(stale_events(dir.file("none.db"), [](torch::optim::SGD& o) { o.zero_grad(); }).empty());
  CHECK(stale_events(dir.file("zeros.db"), [](torch::optim::SGD& o) { o.zero_grad(/*set_to_none=*/false); }).empty());
  CHECK(stale_events(dir.file("micro.db"), [](torch::optim::SGD& o) { o.zero_grad(); }, 4, 4).empty());
}
