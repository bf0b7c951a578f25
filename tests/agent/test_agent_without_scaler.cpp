// The agent without a loss scaler (bf16 autocast): the loop hands it each loss (loss()) and
// steps the optimizer through it (step()). It changes no number, records each step at
// scale 1 with its loss as a run without a scaler, and its report names a NaN update.
#include "../catch_with_torch.h"

#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../analyzer/rule_checks.h"
#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

AgentOptions writing(const std::string& db) {
  AgentOptions o;
  o.db_path = db;
  return o;
}

// `steps` steps of bf16 autocast training with AdamW, `micro` losses a step; with an agent
// made without a scaler where `db` is not empty, the loss of step `nan_at` made NaN.
// Returns the parameters.
std::vector<torch::Tensor> train_bf16(int steps, const std::string& db, int micro = 1, int nan_at = -1,
                                      at::ScalarType dtype = at::kBFloat16) {
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-2));
  std::unique_ptr<Agent> agent = db.empty() ? nullptr : std::make_unique<Agent>(*net, writing(db));
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    for (int k = 0; k < micro; ++k) {
      const auto x = torch::randn({32, 16}), y = torch::randn({32, 1});
      torch::Tensor loss;
      {
        HalfAutocast autocast(c10::DeviceType::CPU, dtype);
        auto h = torch::relu(net->a(x));
        if (agent) h = agent->probe("a", h);
        loss = torch::mse_loss(net->c(torch::relu(net->b(h))).to(torch::kFloat), y);
      }
      if (step == nan_at) loss = loss * std::numeric_limits<float>::quiet_NaN();
      (agent ? agent->loss(loss) : loss).backward();
    }
    if (agent) agent->step(optimizer);
    else optimizer.step();
  }
  if (agent) agent->close();
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
  return params;
}

}  // namespace

TEST_CASE("without a scaler, training with the agent gives bit-identical parameters", "[agent][no-scaler]") {
  TempDir dir;
  const auto without = train_bf16(6, "");
  const auto with = train_bf16(6, dir.file("run.db"));
  REQUIRE(with.size() == without.size());
  for (std::size_t i = 0; i < with.size(); ++i) CHECK(bitwise_equal(with[i], without[i]));
}

TEST_CASE("without a scaler, each step is recorded at scale 1 with its losses, in a run without a scaler",
          "[agent][no-scaler]") {
  TempDir dir;
  train_bf16(5, dir.file("run.db"), 2);
  rundb::RunDbReader reader(dir.file("run.db"));
  const auto meta = reader.meta();
  CHECK(meta.at("scaler_enabled") == "0");
  CHECK(meta.at("amp_dtype") == "bfloat16");
  CHECK(meta.count("scaler_init_scale") == 0);
  const auto steps = reader.steps();
  REQUIRE(steps.size() == 5);
  for (const auto& s : steps) {
    CHECK(s.scale_before == 1.0);
    CHECK(s.scale_after == 1.0);
    CHECK(s.losses == 2);
    CHECK(std::isfinite(s.loss));
    CHECK_FALSE(s.skipped);
  }
  for (const auto& e : reader.events()) CHECK(e.kind != "amp-dtype");  // the guess was right
}

TEST_CASE("without a scaler under fp16 autocast the run is judged in float16, with one amp-dtype event",
          "[agent][no-scaler]") {
  TempDir dir;
  train_bf16(2, dir.file("run.db"), 1, -1, at::kHalf);
  rundb::RunDbReader reader(dir.file("run.db"));
  CHECK(reader.meta().at("amp_dtype") == "float16");
  int events = 0;
  for (const auto& e : reader.events()) events += e.kind == "amp-dtype";
  CHECK(events == 1);
}

TEST_CASE("without a scaler, a healthy run's report is healthy", "[agent][no-scaler]") {
  TempDir dir;
  train_bf16(5, dir.file("run.db"));
  CHECK(rule_checks::report_of(dir.file("run.db")).findings.empty());
}

TEST_CASE("without a scaler, a NaN loss's step is named as the first NaN/Inf update", "[agent][no-scaler]") {
  TempDir dir;
  train_bf16(6, dir.file("run.db"), 1, 3);
  const auto report = rule_checks::report_of(dir.file("run.db"));
  const analyzer::Finding* update = rule_checks::find(report, "nonfinite-update");
  REQUIRE(update != nullptr);
  CHECK(update->steps.front() == 3);
}

TEST_CASE("loss() and step() are refused on an Agent that watches a GradScaler", "[agent][no-scaler]") {
  TempDir dir;
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  Agent agent(*net, scaler, writing(dir.file("run.db")));
  CHECK_THROWS_AS(agent.loss(torch::ones({})), std::logic_error);
  CHECK_THROWS_WITH(agent.step(optimizer), Catch::Contains("scaler.step(optimizer)"));
}

TEST_CASE("a disabled GradScaler's refusal says how to make the Agent without one", "[agent][no-scaler]") {
  TempDir dir;
  TinyNet net;
  GradScalerOptions off;
  off.enabled = false;
  GradScaler disabled(off);
  const auto make = [&] { Agent agent(*net, disabled, writing(dir.file("run.db"))); };
  CHECK_THROWS_WITH(make(), Catch::Contains("ampdiag::Agent agent(model, options)") && Catch::Contains("agent.step(optimizer)"));
}
