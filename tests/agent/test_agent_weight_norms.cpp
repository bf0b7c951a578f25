// The C++ agent's weight sampler: the norms of the weights each sampled step's forward used,
// on the session core's schedule and at the end of the first skipped steps, and the
// optimizer's settings once, and again where a schedule moved the rate 2x or more (what rule
// weight-growth reads).
#include "../catch_with_torch.h"

#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/agent.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/grad_scaler.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using ampdiag::test::TempDir;

namespace {

// Trains `steps` SGD steps of TinyNet under fp16 autocast with the agent; a step in
// `overflow_at` has an Inf loss (skipped); `lr_at(step)`, where given, sets the learning rate
// before each step, as a scheduler does. Returns per step each parameter's (L2, abs-max), by
// its layer id (the order of named_parameters()), as the step's forward used them.
std::map<std::int64_t, std::vector<std::pair<double, double>>> train(
    const std::string& db, std::int64_t steps, const std::set<std::int64_t>& overflow_at = {},
    const std::function<double(std::int64_t)>& lr_at = nullptr) {
  torch::manual_seed(0);
  test::TinyNet net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = db;
  Agent agent(*net, scaler, o);
  std::map<std::int64_t, std::vector<std::pair<double, double>>> seen;
  for (std::int64_t step = 0; step < steps; ++step) {
    if (lr_at) opt.param_groups().front().options().set_lr(lr_at(step));
    for (const auto& p : net->parameters())
      seen[step].emplace_back(p.detach().norm().item<double>(), p.detach().abs().max().item<double>());
    opt.zero_grad();
    torch::Tensor loss;
    {
      test::HalfAutocast autocast;
      const auto x = torch::randn({4, 16});
      loss = net->c(torch::relu(net->b(torch::relu(net->a(x))))).to(torch::kFloat).pow(2).mean();
    }
    if (overflow_at.count(step)) loss = loss * std::numeric_limits<float>::infinity();
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  }
  return seen;
}

}  // namespace

TEST_CASE("the C++ agent records the weights each sampled step's forward used", "[agent][weights]") {
  TempDir dir;
  const auto seen = train(dir.file("run.db"), 10);
  std::set<std::int64_t> steps;
  const auto rows = rundb::RunDbReader(dir.file("run.db")).weight_norms();
  REQUIRE(rows.size() == 7 * seen.at(0).size());
  for (const auto& r : rows) {
    steps.insert(r.step);
    const auto& [l2, absmax] = seen.at(r.step).at(std::size_t(r.layer_id));
    CHECK(std::abs(r.l2 - l2) <= 1e-5 * l2);
    CHECK(r.absmax == absmax);
  }
  CHECK(steps == std::set<std::int64_t>{0, 1, 2, 3, 4, 6, 8});
}

TEST_CASE("the C++ agent records a float64 weight beyond float32 and an empty one as zeros", "[agent][weights]") {
  // Both through torch's foreach norms; its infinity norm raises for an empty tensor.
  TempDir dir;
  torch::manual_seed(0);
  test::TinyNet net;
  net->register_parameter("wide", torch::full({16}, 1e100, torch::kDouble), /*requires_grad=*/false);
  net->register_parameter("none", torch::empty({0}, torch::kDouble), /*requires_grad=*/false);
  torch::optim::SGD opt(net->a->parameters(), torch::optim::SGDOptions(0.05));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = dir.file("run.db");
  {
    Agent agent(*net, scaler, o);
    torch::Tensor loss;
    {
      test::HalfAutocast autocast;
      loss = net->a(torch::randn({4, 16})).to(torch::kFloat).pow(2).mean();
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  }
  rundb::RunDbReader reader(dir.file("run.db"));
  std::map<std::string, std::pair<double, double>> at_start;
  const auto layers = reader.layers();
  for (const auto& r : reader.weight_norms())
    if (r.step == 0) at_start[layers.at(std::size_t(r.layer_id)).name] = {r.l2, r.absmax};
  REQUIRE(at_start.count("wide") == 1);
  CHECK(at_start["wide"].first == Approx(4e100).epsilon(1e-9));
  CHECK(at_start["wide"].second == Approx(1e100).epsilon(1e-9));
  CHECK(at_start["none"] == std::pair<double, double>{0.0, 0.0});
  CHECK(at_start.count("a.weight") == 1);
}

TEST_CASE("the C++ agent reads skipped steps' weights off the schedule", "[agent][weights]") {
  TempDir dir;
  train(dir.file("run.db"), 16, {11, 13});
  rundb::RunDbReader reader(dir.file("run.db"));
  std::set<std::int64_t> read;
  for (const auto& r : reader.weight_norms()) read.insert(r.step);
  CHECK(read.count(11) == 1);
  CHECK(read.count(13) == 1);
  CHECK(read.count(14) == 0);  // neither on the schedule nor skipped
  std::vector<std::int64_t> skipped;
  for (const auto& s : reader.steps())
    if (s.skipped) skipped.push_back(s.step);
  CHECK(skipped == std::vector<std::int64_t>{11, 13});
}

TEST_CASE("the C++ agent records the optimizer's settings once", "[agent][weights]") {
  TempDir dir;
  train(dir.file("run.db"), 5);
  std::vector<std::string> settings;
  for (const auto& e : rundb::RunDbReader(dir.file("run.db")).events())
    if (e.kind == "optimizer-settings") settings.push_back(e.detail);
  CHECK(settings == std::vector<std::string>{"SGD lr=0.05 weight_decay=0 momentum=0.9"});
}

namespace {

std::vector<std::pair<std::int64_t, std::string>> settings_events(const std::string& db) {
  std::vector<std::pair<std::int64_t, std::string>> settings;
  for (const auto& e : rundb::RunDbReader(db).events())
    if (e.kind == "optimizer-settings") settings.emplace_back(e.step, e.detail);
  return settings;
}

}  // namespace

TEST_CASE("the C++ agent records the settings again on a sampled step once a schedule moved the rate twofold",
          "[agent][weights]") {
  TempDir dir;
  train(dir.file("run.db"), 10, {}, [](std::int64_t step) { return step >= 5 ? 0.2 : 0.05; });
  using Said = std::vector<std::pair<std::int64_t, std::string>>;
  CHECK(settings_events(dir.file("run.db")) ==
        Said{{0, "SGD lr=0.05 weight_decay=0 momentum=0.9"}, {6, "SGD lr=0.2 weight_decay=0 momentum=0.9"}});
}

TEST_CASE("the C++ agent does not record a rate moved less than twofold again", "[agent][weights]") {
  TempDir dir;
  train(dir.file("run.db"), 10, {}, [](std::int64_t step) { return step >= 5 ? 0.075 : 0.05; });
  CHECK(settings_events(dir.file("run.db")).size() == 1);
}

namespace {

// The Python scenario tests/scenarios/test_weight_growth.py in LibTorch: an MLP trained with
// AdamW at `lr` under fp16 autocast for 30 steps.
void train_mlp(const std::string& db, double lr) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 256), torch::nn::GELU(), torch::nn::Linear(256, 256),
                              torch::nn::GELU(), torch::nn::Linear(256, 256), torch::nn::GELU(), torch::nn::Linear(256, 10));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(lr));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = db;
  Agent agent(*model, scaler, o);
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      test::HalfAutocast autocast;
      loss = torch::cross_entropy_loss(model->forward(torch::randn({64, 32})).to(torch::kFloat),
                                       torch::randint(0, 10, {64}));
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  }
}

}  // namespace

TEST_CASE("a LibTorch loop whose learning rate is far too high is reported as weight growth", "[agent][weights]") {
  TempDir dir;
  train_mlp(dir.file("run.db"), 0.3);
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  REQUIRE_FALSE(report.findings.empty());
  const auto& first = report.findings.front();
  CHECK(first.rule == "weight-growth");
  CHECK_THAT(first.evidence, Catch::Contains("optimizer: AdamW lr=0.3"));
  CHECK_THAT(first.suggestions.front().cpp,
             Catch::StartsWith("torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(/*lr=*/0.03));"));
}

TEST_CASE("the same LibTorch loop at a sane learning rate has no weight growth", "[agent][weights]") {
  TempDir dir;
  train_mlp(dir.file("run.db"), 1e-3);
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  for (const auto& f : report.findings) CHECK(f.rule != "weight-growth");
  CHECK(report.findings.empty());
}
