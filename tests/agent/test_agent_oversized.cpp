// A LibTorch CNN trained the way its users write it: no module run through agent.forward(),
// so the report has the gradients' backward order and the weights' norms, no module rows.
#include "../catch_with_torch.h"

#include <algorithm>
#include <string>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl() {
    features = register_module(
        "features", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                                          torch::nn::BatchNorm2d(8), torch::nn::ReLU(), torch::nn::AdaptiveAvgPool2d(1)));
    fc = register_module("fc", torch::nn::Linear(8, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(features->forward(x).flatten(1)); }
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SmallCnn);

// 30 steps of cross-entropy on random images and labels under fp16 autocast, SGD with
// momentum, the gradients clipped to a norm of 5, fc's weights multiplied by `fc_gain` first;
// the report of the run.
analyzer::Report train_cnn(const std::string& db, double fc_gain) {
  torch::manual_seed(0);
  SmallCnn net;
  {
    torch::NoGradGuard no_grad;
    net->fc->weight.mul_(fc_gain);
  }
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  GradScaler scaler;
  const auto x = torch::randn({128, 3, 8, 8});
  const auto y = torch::randint(0, 10, {128});
  {
    Agent agent(*net, scaler, options_for(db));
    for (int step = 0; step < 30; ++step) {
      optimizer.zero_grad();
      const std::int64_t i = (step % 4) * 32;
      torch::Tensor logits;
      {
        HalfAutocast autocast;
        logits = net->forward(x.slice(0, i, i + 32));
      }
      scaler.scale(torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y.slice(0, i, i + 32))).backward();
      scaler.unscale_(optimizer);
      torch::nn::utils::clip_grad_norm_(net->parameters(), 5.0);
      scaler.step(optimizer);
      scaler.update();
    }
  }
  return analyzer::analyze({analyzer::load_run(db)});
}

}  // namespace

TEST_CASE("a LibTorch CNN whose last Linear starts far too large is told to re-initialise it before any pin",
          "[agent][oversized]") {
  // fc's backward sends the BatchNorm before it gradients that overflow fp16: its pin would
  // not touch fc's backward.
  TempDir dir;
  const auto report = train_cnn(dir.file("run.db"), 20000.0);
  const auto origin = std::find_if(report.findings.begin(), report.findings.end(),
                                   [](const analyzer::Finding& f) { return f.rule == "overflow-origin"; });
  REQUIRE(origin != report.findings.end());
  CHECK(origin->severity == analyzer::Severity::kError);
  REQUIRE_FALSE(origin->suggestions.empty());
  CHECK_THAT(origin->suggestions.front().summary, Catch::StartsWith("Initialise fc at a standard scale"));
}

TEST_CASE("the same LibTorch CNN at torch's default initialisation is healthy", "[agent][oversized]") {
  TempDir dir;
  const auto report = train_cnn(dir.file("run.db"), 1.0);
  for (const auto& f : report.findings) CHECK(f.severity == analyzer::Severity::kInfo);
}
