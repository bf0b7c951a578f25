// The C++ agent's reading of a module's own code (event "module-code"), as the Python agent's:
// where a module of the program's, run through Agent::forward(), made the step's first NaN/Inf
// itself, the operations its forward() ran after its input, which the report follows to a fix
// of that code (an eps under a root, an exp() of a bounded value) instead of "look at its code".
#include "../catch_with_torch.h"

#include <functional>
#include <string>
#include <vector>

#include "../analyzer/rule_checks.h"
#include "../rundb/temp_dir.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

// A module of the program's whose forward() is `code` on its input.
// Cloneable, as a module the agent replays in FP32 on a copy must be.
struct OwnCodeImpl : torch::nn::Cloneable<OwnCodeImpl> {
  std::function<torch::Tensor(const torch::Tensor&)> code;
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return code(x); }
};
TORCH_MODULE(OwnCode);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(std::function<torch::Tensor(const torch::Tensor&)> code) {
    a = register_module("a", torch::nn::Linear(16, 32));
    own = register_module("own", OwnCode());
    own->code = std::move(code);
    b = register_module("b", torch::nn::Linear(32, 1));
  }
  torch::nn::Linear a{nullptr};
  OwnCode own{nullptr};
  torch::nn::Linear b{nullptr};
};
TORCH_MODULE(Net);

// 12 fp16 steps of Net(code) through agent.forward(): its input times `gain`, and a's output
// zeroed on 16 of the 64 rows where `zero_rows`.
std::string run_own_code(const TempDir& dir, std::function<torch::Tensor(const torch::Tensor&)> code,
                         bool zero_rows = false, double gain = 1.0) {
  torch::manual_seed(0);
  Net net(std::move(code));
  agent_steps(*net, dir.file("run.db"), 12, 1e-3, [&](Agent& agent) {
    const auto x = torch::randn({64, 16}) * gain;
    const auto a = agent.forward("a", net->a, x);
    // Padding rows: a's output is 0 there, as an embedding's padding row is.
    const auto h = zero_rows ? a * (torch::arange(64) < 48).unsqueeze(1).to(a.scalar_type()) : a;
    const auto y = agent.forward("own", net->own, h);
    return agent.forward("b", net->b, y).to(torch::kFloat).pow(2).mean();
  });
  return dir.file("run.db");
}

torch::Tensor rms_without_eps(const torch::Tensor& x) { return x * torch::rsqrt(x.pow(2).mean(-1, true)); }
torch::Tensor exp_of_30x(const torch::Tensor& x) { return (x * 30).exp(); }

}  // namespace

TEST_CASE("a module of the program's that makes NaN from finite inputs has its own code read", "[agent][own-code]") {
  TempDir dir;
  CHECK(event_details(run_own_code(dir, rms_without_eps, true), "module-code") ==
        std::vector<std::string>{"own: Pow(2):float16, Mean:float16, Rsqrt:float16, Mul:float16"});
}

TEST_CASE("a root without eps in a module's own code is kept off 0 first, with its C++ line", "[agent][own-code]") {
  TempDir dir;
  const auto report = rule_checks::report_of(run_own_code(dir, rms_without_eps, true));
  const analyzer::Finding* found = rule_checks::find(report, "forward-nonfinite");
  REQUIRE(found != nullptr);
  const analyzer::Finding& f = *found;
  REQUIRE_FALSE(f.suggestions.empty());
  CHECK_THAT(f.suggestions[0].summary,
             Catch::StartsWith("Keep what own's own code takes the reciprocal square root of (Rsqrt) off 0"));
  CHECK_THAT(f.suggestions[0].cpp, Catch::Contains("x = x * torch::rsqrt(variance + eps);"));
}

TEST_CASE("an exp() in a module's own code that passes fp16's range has its argument bounded", "[agent][own-code]") {
  TempDir dir;
  const std::string db = run_own_code(dir, exp_of_30x);
  CHECK(event_details(db, "module-code") == std::vector<std::string>{"own: Mul(30):float16, Exp:float16"});
  const auto report = rule_checks::report_of(db);
  const analyzer::Finding* found = rule_checks::find(report, "forward-nonfinite");
  REQUIRE(found != nullptr);
  const analyzer::Finding& f = *found;
  REQUIRE_FALSE(f.suggestions.empty());
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("Bound what own's own code passes to exp() (Exp)"));
  CHECK_THAT(f.suggestions[0].cpp, Catch::Contains("torch::tanh(s)"));
}

TEST_CASE("torch's own Linear that goes NaN/Inf first has no code of its own read", "[agent][own-code]") {
  TempDir dir;
  // Inputs beyond fp16's range: a's output is Inf, and its FP32 replay finite.
  const std::string db = run_own_code(dir, [](const torch::Tensor& x) { return x; }, false, 3e4);
  const auto report = rule_checks::report_of(db);
  const analyzer::Finding* f = rule_checks::find(report, "forward-nonfinite");
  REQUIRE(f != nullptr);
  CHECK(f->module == "a");
  CHECK(event_details(db, "module-code").empty());
}

TEST_CASE("forwards with gradients on between steps hold no earlier forward's graph", "[agent][own-code]") {
  // A validation pass without NoGradGuard: what marks the step's outputs for the code reads
  // must not keep every batch's activations alive until the next step.
  TempDir dir;
  torch::manual_seed(0);
  Net net([](const torch::Tensor& x) { return x; });
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  Agent agent(*net, scaler, options_for(dir.file("run.db")));
  amp_steps(1, optimizer, scaler, [&](int) {
    return agent.forward("b", net->b, agent.forward("a", net->a, torch::randn({8, 16}))).to(torch::kFloat).mean();
  });
  c10::weak_intrusive_ptr<torch::autograd::Node> first(c10::intrusive_ptr<torch::autograd::Node>{});
  for (int batch = 0; batch < 3; ++batch) {
    const auto y = agent.forward("b", net->b, agent.forward("a", net->a, torch::randn({8, 16})));
    if (batch == 0) first = c10::weak_intrusive_ptr<torch::autograd::Node>(y.grad_fn());
  }
  CHECK(first.expired());
}
