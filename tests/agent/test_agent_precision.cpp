// The C++ agent's precision checks (AgentOptions::precision_budget) for modules run through
// Agent::forward(): a hand-written RMSNorm whose x.pow(2) overflows fp16 inside it hands on
// zeros, no NaN anywhere; the check runs it again in FP32 and the report names it.
#include "../catch_with_torch.h"

#include <torch/torch.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

// x / rms(x), written out: in fp16, x.pow(2) is Inf for |x| above 256, rsqrt(Inf) is 0, and
// the output is all zeros. The dropout draws random numbers: a check that did not replay the
// call's draws would differ from it, and one that did not restore the RNG would change the
// training.
struct NormImpl : torch::nn::Cloneable<NormImpl> {
  NormImpl() { reset(); }
  void reset() override { drop = register_module("drop", torch::nn::Dropout(0.1)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return drop(x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6));
  }
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Norm);

struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    up = register_module("up", torch::nn::Linear(16, 64));
    norm = register_module("norm", Norm());
    head = register_module("head", torch::nn::Linear(64, 1));
  }
  torch::nn::Linear up{nullptr};
  Norm norm{nullptr};
  torch::nn::Linear head{nullptr};
};

// `steps` SGD steps under fp16 autocast with inputs of `sigma` (1000: the norm's squares
// overflow; 1: they do not); the norm runs through agent.forward(), after a module "scale"
// whose replay throws where `failing` says. Returns the parameters.
std::vector<torch::Tensor> train(std::optional<AgentOptions> options, double sigma, int steps = 8,
                                 bool failing = false) {
  torch::manual_seed(0);
  auto net = std::make_shared<NormNetImpl>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1e-3));
  GradScaler scaler;
  std::unique_ptr<Agent> agent;
  if (options) agent = std::make_unique<Agent>(*net, scaler, *options);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      HalfAutocast autocast;
      auto h = net->up(torch::randn({8, 16}) * sigma);
      if (agent && failing)
        h = agent->forward_as(
            "scale", [](const torch::Tensor& x) { return x * 1.0; },
            [](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("this module cannot be copied"); }, h);
      const auto n = agent ? agent->forward("norm", net->norm, h) : net->norm->forward(h);
      loss = net->head(n).pow(2).mean().to(torch::kFloat);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  }
  agent.reset();
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
  return params;
}

AgentOptions checked(const std::string& db, double budget = 1.0) {
  AgentOptions o;
  o.db_path = db;
  o.precision_budget = budget;  // 1: a check every step (the rotation holds one module)
  return o;
}

}  // namespace

TEST_CASE("a module whose fp16 output lost its values is checked against FP32", "[agent][precision]") {
  TempDir dir;
  train(checked(dir.file("run.db")), 1000.0);
  const auto rows = rundb::RunDbReader(dir.file("run.db")).precision_checks();
  REQUIRE(rows.size() >= 6);  // every step but the first, whose cycle began before forward() named the module
  for (const auto& r : rows) {
    CHECK(r.module == "norm");
    CHECK(r.dtype == "float16");
    CHECK(r.rel_error == 1.0);  // all zeros where FP32's are not
    CHECK(r.zeroed * 10 >= r.numel * 8);  // the dropout zeroes a tenth in both
  }
}

TEST_CASE("a precise module's check finds only fp16's rounding", "[agent][precision]") {
  TempDir dir;
  train(checked(dir.file("run.db")), 1.0);
  const auto rows = rundb::RunDbReader(dir.file("run.db")).precision_checks();
  REQUIRE_FALSE(rows.empty());
  for (const auto& r : rows) {
    CHECK(r.rel_error < 0.01);  // the same dropout masks: nothing but rounding differs
    CHECK(r.zeroed == 0);
  }
}

TEST_CASE("the report names the module whose precision check lost its output", "[agent][precision]") {
  TempDir dir;
  train(checked(dir.file("run.db")), 1000.0);
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  REQUIRE_FALSE(report.findings.empty());
  CHECK(report.findings.front().rule == "precision-loss");
  CHECK(report.findings.front().module == "norm");
}

TEST_CASE("precision checks leave the training bit-identical", "[agent][precision]") {
  TempDir dir;
  const auto plain = train(std::nullopt, 1.0);
  const auto watched = train(checked(dir.file("run.db")), 1.0);
  REQUIRE(plain.size() == watched.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(torch::equal(plain[i], watched[i]));
  CHECK_FALSE(rundb::RunDbReader(dir.file("run.db")).precision_checks().empty());
}

TEST_CASE("autopin pins a module whose check found its output lost", "[agent][precision]") {
  TempDir dir;
  AgentOptions o = checked(dir.file("run.db"));
  o.autopin = 1;
  train(o, 1000.0);
  rundb::RunDbReader reader(dir.file("run.db"));
  std::vector<std::string> events;
  for (const auto& e : reader.events())
    if (e.kind.rfind("autopin", 0) == 0) events.push_back(e.kind + " " + e.detail);
  CHECK(events == std::vector<std::string>{"autopin-precision norm: 100 % away from FP32", "autopin norm"});
  CHECK(reader.precision_checks().size() == 1);  // pinned, it runs in FP32: nothing left to compare
}

TEST_CASE("a module whose check fails leaves the rotation for good", "[agent][precision]") {
  TempDir dir;
  train(checked(dir.file("run.db")), 1.0, 12, /*failing=*/true);
  std::vector<std::int64_t> norm_steps;
  for (const auto& r : rundb::RunDbReader(dir.file("run.db")).precision_checks()) {
    CHECK(r.module == "norm");
    norm_steps.push_back(r.step);
  }
  // "scale" failed once, at its first turn: every later step checks "norm" (not every other one)
  CHECK(norm_steps.size() >= 9);
}

TEST_CASE("a precision budget of 0 runs no check", "[agent][precision]") {
  TempDir dir;
  train(checked(dir.file("run.db"), 0.0), 1000.0);
  CHECK(rundb::RunDbReader(dir.file("run.db")).precision_checks().empty());
}

TEST_CASE("a precision budget outside 0..1 is refused", "[agent][precision]") {
  TempDir dir;
  TinyNet net;
  GradScaler scaler;
  CHECK_THROWS_AS(Agent(*net, scaler, checked(dir.file("run.db"), 1.5)), std::invalid_argument);
  CHECK_THROWS_AS(Agent(*net, scaler, checked(dir.file("run.db"), -0.1)), std::invalid_argument);
}
