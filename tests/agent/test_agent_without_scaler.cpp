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
#include "no_scaler_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

NoScalerLoop loop_of(int steps, const std::string& db) {
  NoScalerLoop loop;
  loop.steps = steps;
  loop.db = db;
  return loop;
}

}  // namespace

TEST_CASE("without a scaler, training with the agent gives bit-identical parameters", "[agent][no-scaler]") {
  TempDir dir;
  const auto without = train_without_scaler(loop_of(6, ""));
  const auto with = train_without_scaler(loop_of(6, dir.file("run.db")));
  REQUIRE(with.size() == without.size());
  for (std::size_t i = 0; i < with.size(); ++i) CHECK(bitwise_equal(with[i], without[i]));
}

TEST_CASE("without a scaler, each step is recorded at scale 1 with its losses, in a run without a scaler",
          "[agent][no-scaler]") {
  TempDir dir;
  NoScalerLoop loop = loop_of(5, dir.file("run.db"));
  loop.micro = 2;
  train_without_scaler(loop);
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
  NoScalerLoop loop = loop_of(2, dir.file("run.db"));
  loop.dtype = at::kHalf;
  train_without_scaler(loop);
  rundb::RunDbReader reader(dir.file("run.db"));
  CHECK(reader.meta().at("amp_dtype") == "float16");
  int events = 0;
  for (const auto& e : reader.events()) events += e.kind == "amp-dtype";
  CHECK(events == 1);
}

TEST_CASE("without a scaler, a healthy run's report is healthy", "[agent][no-scaler]") {
  TempDir dir;
  train_without_scaler(loop_of(5, dir.file("run.db")));
  CHECK(rule_checks::report_of(dir.file("run.db")).findings.empty());
}

TEST_CASE("without a scaler, a NaN loss's step is named as the first NaN/Inf update", "[agent][no-scaler]") {
  TempDir dir;
  NoScalerLoop loop = loop_of(6, dir.file("run.db"));
  loop.nan_at = 3;
  train_without_scaler(loop);
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
  Agent agent(*net, scaler, options_for(dir.file("run.db")));
  CHECK_THROWS_AS(agent.loss(torch::ones({})), std::logic_error);
  CHECK_THROWS_WITH(agent.step(optimizer), Catch::Contains("scaler.step(optimizer)"));
}

TEST_CASE("a disabled GradScaler's refusal says how to make the Agent without one", "[agent][no-scaler]") {
  TempDir dir;
  TinyNet net;
  GradScalerOptions off;
  off.enabled = false;
  GradScaler disabled(off);
  const auto make = [&] { Agent agent(*net, disabled, options_for(dir.file("run.db"))); };
  CHECK_THROWS_WITH(make(), Catch::Contains("ampdiag::Agent agent(model, options)") && Catch::Contains("agent.step(optimizer)"));
}

TEST_CASE("without a scaler, a float16 loss is no half-loss: no scale multiplies its gradient", "[agent][no-scaler]") {
  TempDir dir;
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  {
    Agent agent(*net, options_for(dir.file("run.db")));
    agent.loss(net->c(net->b(net->a(torch::randn({4, 16})))).mean().to(torch::kHalf)).backward();
    agent.step(optimizer);
  }
  rundb::RunDbReader reader(dir.file("run.db"));
  REQUIRE(reader.steps().size() == 1);
  for (const auto& e : reader.events()) CHECK(e.kind != "half-loss");
}
