// Agent::forward() in a real fp16-autocast LibTorch loop: the first module whose output holds
// NaN/Inf is replayed once in FP32 on a clone (the training unchanged), and with
// AgentOptions::autopin a confirmed module runs in FP32 from the next step on.
#include "../catch_with_torch.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <optional>

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

// softmax(q(x) * gain): q(x) * gain overflows fp16 (not FP32) for |q(x)| above 65504 / gain.
// The dropout draws random numbers, so a replay that did not restore the RNG would show.
struct ScoresImpl : torch::nn::Cloneable<ScoresImpl> {
  explicit ScoresImpl(double gain) : gain(gain) { reset(); }
  void reset() override {
    q = register_module("q", torch::nn::Linear(16, 16));
    drop = register_module("drop", torch::nn::Dropout(0.1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return drop((q(x) * gain).softmax(-1)); }
  double gain;
  torch::nn::Linear q{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Scores);

// The same, but a plain Module: clone() cannot copy it.
struct PlainScoresImpl : torch::nn::Module {
  explicit PlainScoresImpl(double gain) : gain(gain) { q = register_module("q", torch::nn::Linear(16, 16)); }
  torch::Tensor forward(const torch::Tensor& x) { return (q(x) * gain).softmax(-1); }
  double gain;
  torch::nn::Linear q{nullptr};
};
TORCH_MODULE(PlainScores);

template <class Block>
struct NetImpl : torch::nn::Module {
  explicit NetImpl(double gain) {
    scores = register_module("scores", Block(gain));
    head = register_module("head", torch::nn::Linear(16, 1));
  }
  Block scores{nullptr};
  torch::nn::Linear head{nullptr};
};

struct Trained {
  std::vector<bool> skipped;
  std::vector<torch::Tensor> params;
};

// Inputs of 4 sigma overflow the scores for `overflowing` steps; after them, inputs of 0.05
// sigma do not (the dropout still draws every step).
template <class Block>
Trained train(std::optional<AgentOptions> options, int overflowing = 6, double gain = 3e4, int steps = 6) {
  torch::manual_seed(0);
  auto net = std::make_shared<NetImpl<Block>>(gain);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1e-4));
  GradScalerOptions so;
  so.init_scale = 256.0;
  GradScaler scaler(so);
  const auto x = torch::randn({4, 8, 16});
  std::unique_ptr<Agent> agent;
  if (options) agent = std::make_unique<Agent>(*net, scaler, *options);
  Trained t;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      HalfAutocast autocast;
      const auto in = x * (i < overflowing ? 4.0 : 0.05);
      const auto s = agent ? agent->forward("scores", net->scores, in) : net->scores->forward(in);
      loss = net->head(in + s).mean().to(torch::kFloat);
    }
    scaler.scale(loss).backward();
    t.skipped.push_back(!scaler.step(opt));
    scaler.update();
  }
  agent.reset();
  for (const auto& p : net->parameters()) t.params.push_back(p.detach().clone());
  return t;
}

AgentOptions options(const std::string& db, std::int64_t autopin) {
  AgentOptions o;
  o.db_path = db;
  o.autopin = autopin;
  return o;
}

std::vector<rundb::EventRow> events_of(const std::string& db, const std::string& kind) {
  std::vector<rundb::EventRow> out;
  for (const auto& e : rundb::RunDbReader(db).events())
    if (e.kind == kind) out.push_back(e);
  return out;
}

}  // namespace

TEST_CASE("the replay of the first non-finite module is recorded and changes no number of the training",
          "[agent][replay]") {
  TempDir dir;
  const auto without = train<Scores>(std::nullopt, 1);
  REQUIRE(without.skipped == std::vector<bool>({true, false, false, false, false, false}));
  const auto with = train<Scores>(options(dir.file("run.db"), 0), 1);
  REQUIRE(with.skipped == without.skipped);
  for (std::size_t i = 0; i < with.params.size(); ++i) REQUIRE(torch::equal(with.params[i], without.params[i]));
  const auto replays = rundb::RunDbReader(dir.file("run.db")).replays();
  REQUIRE(replays.size() == 1);
  REQUIRE(replays[0].module == "scores");
  REQUIRE(replays[0].outcome == "finite");
  REQUIRE(replays[0].step == 0);
  REQUIRE(std::isfinite(replays[0].fp32_absmax));
  REQUIRE(events_of(dir.file("run.db"), "autopin").empty());
}

TEST_CASE("autopin runs a confirmed module in FP32 from the next step on and says so", "[agent][replay]") {
  TempDir dir;
  const auto t = train<Scores>(options(dir.file("run.db"), 1));
  REQUIRE(t.skipped == std::vector<bool>({true, false, false, false, false, false}));
  const auto pins = events_of(dir.file("run.db"), "autopin");
  REQUIRE(pins.size() == 1);
  REQUIRE(pins[0].step == 1);
  REQUIRE(pins[0].detail == "scores");
}

TEST_CASE("a module that cannot be cloned is replayed as unconfirmed and never pinned", "[agent][replay]") {
  TempDir dir;
  const auto t = train<PlainScores>(options(dir.file("run.db"), 1));
  REQUIRE(t.skipped == std::vector<bool>(6, true));
  const auto replays = rundb::RunDbReader(dir.file("run.db")).replays();
  REQUIRE(replays.size() == 1);  // six steps overflowed: once per module and run
  REQUIRE(replays[0].outcome == "unconfirmed");
  REQUIRE_THAT(replays[0].reason, Catch::Contains("clone"));
  REQUIRE(events_of(dir.file("run.db"), "autopin").empty());
}

TEST_CASE("autopin without replay, or below zero, is refused", "[agent][replay]") {
  TempDir dir;
  auto net = std::make_shared<NetImpl<Scores>>(1.0);  // never trained
  GradScaler scaler;
  AgentOptions o = options(dir.file("a.db"), 1);
  o.replay = false;
  REQUIRE_THROWS_WITH(Agent(*net, scaler, o), Catch::Contains("autopin needs replay"));
  REQUIRE_THROWS_WITH(Agent(*net, scaler, options(dir.file("b.db"), -1)), Catch::Contains("autopin must be >= 0"));
}

namespace {

// Fills the upper triangle with -inf, as a causal mask does: NaN/Inf in any precision.
struct MaskImpl : torch::nn::Cloneable<MaskImpl> {
  MaskImpl() { reset(); }
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto n = x.size(-1);
    return x.masked_fill(torch::ones({n, n}, torch::kBool).triu(1), -std::numeric_limits<double>::infinity());
  }
};
TORCH_MODULE(Mask);

}  // namespace

TEST_CASE("a module making -inf from finite inputs is replayed as intrinsic and never pinned", "[agent][replay]") {
  TempDir dir;
  torch::manual_seed(0);
  Mask mask;
  torch::nn::Linear head(16, 1);
  torch::optim::SGD opt(head->parameters(), torch::optim::SGDOptions(1e-3));
  GradScalerOptions so;
  so.init_scale = 256.0;
  GradScaler scaler(so);
  {
    Agent agent(*head, scaler, options(dir.file("run.db"), 1));
    for (int i = 0; i < 3; ++i) {
      opt.zero_grad();
      torch::Tensor loss;
      {
        HalfAutocast autocast;
        const auto x = torch::randn({4, 16, 16});
        loss = head(agent.forward("mask", mask, x).softmax(-1)).mean().to(torch::kFloat);
      }
      REQUIRE(std::isfinite(loss.item<double>()));  // the softmax absorbs the -inf
      scaler.scale(loss).backward();
      REQUIRE(scaler.step(opt));
      scaler.update();
    }
  }
  const auto replays = rundb::RunDbReader(dir.file("run.db")).replays();
  REQUIRE(replays.size() == 1);
  REQUIRE(replays[0].outcome == "intrinsic");
  REQUIRE(events_of(dir.file("run.db"), "autopin").empty());
}

TEST_CASE("the modules the loop runs in FP32 (AgentOptions::pinned_fp32) are one pinned-fp32 event each",
          "[agent][replay]") {
  TempDir dir;
  auto net = std::make_shared<NetImpl<Scores>>(1.0);
  GradScaler scaler;
  AgentOptions o = options(dir.file("run.db"), 0);
  o.pinned_fp32 = {"scores", "head", "scores"};
  Agent(*net, scaler, o).close();
  std::vector<std::string> pinned;
  for (const auto& e : events_of(dir.file("run.db"), "pinned-fp32")) pinned.push_back(e.detail);
  REQUIRE(pinned == std::vector<std::string>({"head", "scores"}));
}

TEST_CASE("an empty path in AgentOptions::pinned_fp32 is refused before anything is attached", "[agent][replay]") {
  TempDir dir;
  auto net = std::make_shared<NetImpl<Scores>>(1.0);
  GradScaler scaler;
  AgentOptions o = options(dir.file("run.db"), 0);
  o.pinned_fp32 = {"scores", ""};
  REQUIRE_THROWS_WITH(Agent(*net, scaler, o), Catch::Contains("pinned_fp32 holds an empty module path"));
  REQUIRE(scaler.observer() == nullptr);
  REQUIRE_FALSE(std::filesystem::exists(dir.file("run.db")));
}
