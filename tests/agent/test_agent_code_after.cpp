// The C++ agent's reading of the code after the module a skip names (agent/src/code_after.h),
// as the Python agent's: the operations from its output to the loss (event "output-code") and
// the first of them whose backward made the NaN/Inf ("output-code-origin"), which the report
// follows to tell a pin that stops at a matmul autocast keeps in fp16 from one that helps.
#include "../catch_with_torch.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "../analyzer/rule_checks.h"
#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

using LossOfOutputs = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;
using AfterA = std::function<torch::Tensor(const torch::Tensor&)>;

// 24 steps of TinyNet's a, b and c run through agent.forward() under fp16 autocast: the model's
// own code `after_a` on a's output, b on that, and the loss `loss_of(a's output, b's output)`,
// or where none is given, c's output on relu(b's) squared and averaged.
std::string run_code_after(const TempDir& dir, const LossOfOutputs& loss_of, const AfterA& after_a = nullptr) {
  tiny_agent_steps(dir.file("run.db"), 24, [&](Agent& agent, TinyNet& net) {
    const auto x = agent.input("x", torch::randn({64, 16}));
    const auto a = agent.forward("a", net->a, x);
    const auto b = agent.forward("b", net->b, after_a ? after_a(a) : a);
    if (loss_of) return loss_of(a, b);
    return agent.forward("c", net->c, torch::relu(b)).to(torch::kFloat).pow(2).mean();
  });
  return dir.file("run.db");
}

// Two embeddings' similarities times a temperature of 98716 (CLIP's exp(11.5)), their
// cross-entropy: the Mul after the Mm overflows the gradient it sends back in fp16.
torch::Tensor similarities_loss(const torch::Tensor& a, const torch::Tensor& b) {
  namespace F = torch::nn::functional;
  const auto za = F::normalize(a, F::NormalizeFuncOptions().dim(1));
  const auto zb = F::normalize(b, F::NormalizeFuncOptions().dim(1));
  return F::cross_entropy((za.mm(zb.t()) * 98716.0).to(torch::kFloat), torch::arange(64));
}

// CLIP's shape: two encoders, and the model's own temperature, logit_scale, whose exp()
// scales their similarities.
struct TowersImpl : torch::nn::Module {
  explicit TowersImpl(double logit_scale) {
    a = register_module("a", torch::nn::Linear(16, 32));
    b = register_module("b", torch::nn::Linear(16, 32));
    this->logit_scale = register_parameter("logit_scale", torch::full({}, logit_scale));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor logit_scale;
};
TORCH_MODULE(Towers);

// 24 steps of Towers(logit_scale) with a and b run through agent.forward() on one batch.
std::string run_towers(const TempDir& dir, double logit_scale) {
  namespace F = torch::nn::functional;
  torch::manual_seed(0);
  Towers towers(logit_scale);
  agent_steps(*towers, dir.file("run.db"), 24, 1e-4, [&](Agent& agent) {
    const auto x = agent.input("x", torch::randn({64, 16}));
    const auto za = F::normalize(agent.forward("a", towers->a, x), F::NormalizeFuncOptions().dim(1));
    const auto zb = F::normalize(agent.forward("b", towers->b, x), F::NormalizeFuncOptions().dim(1));
    return F::cross_entropy((za.mm(zb.t()) * towers->logit_scale.exp()).to(torch::kFloat), torch::arange(64));
  });
  return dir.file("run.db");
}

const analyzer::Finding& overflow_origin_of(const analyzer::Report& report) {
  const auto f = std::find_if(report.findings.begin(), report.findings.end(),
                              [](const analyzer::Finding& x) { return x.rule == "overflow-origin"; });
  REQUIRE(f != report.findings.end());
  return *f;
}

}  // namespace

TEST_CASE("the code after a module is read where NaN/Inf reaches its output", "[agent][code-after]") {
  TempDir dir;
  const std::string db = run_code_after(dir, similarities_loss);
  const std::vector<std::string> code = event_details(db, "output-code");
  REQUIRE(code.size() == 1);
  CHECK_THAT(code[0], Catch::Matches("[ab]: .*Mm:float16, Mul:float16, .*"));
}

TEST_CASE("the first operation of that code whose backward made them is traced at a later skip",
          "[agent][code-after]") {
  TempDir dir;
  const std::string db = run_code_after(dir, similarities_loss);
  const std::vector<std::string> origin = event_details(db, "output-code-origin");
  REQUIRE(origin.size() == 1);
  CHECK_THAT(origin[0], Catch::EndsWith("Mm:float16, Mul:float16"));
  // The report then quotes it, and offers no pin of the module alone: the temperature of 98716
  // makes the other encoder's gradients as large, which hold the scale below the floor too.
  const auto report = analyzer::analyze({analyzer::load_run(db)});
  const analyzer::Finding& o = overflow_origin_of(report);
  CHECK_THAT(o.evidence, Catch::Contains("Mul (float16) was the first of it whose backward sent NaN/Inf back from "
                                         "finite gradients, after"));
  for (const auto& fix : o.suggestions) CHECK_THAT(fix.summary, !Catch::Contains("in FP32 (pinned"));
}

TEST_CASE("a gain after a module, before any matmul, keeps the module's pin first", "[agent][code-after]") {
  // a's output divided, then multiplied by 3e6 in fp16 (test_agent_gradient_entry.cpp's gain,
  // a thousand times over, so that the scale collapses): the Mul's backward overflows what b's
  // backward sends, and pinned, a's float32 output keeps it in float32.
  TempDir dir;
  const std::string db =
      run_code_after(dir, nullptr, [](const torch::Tensor& h) { return (h / 3e6) * 3e6; });
  const std::vector<std::string> origin = event_details(db, "output-code-origin");
  REQUIRE(origin.size() == 1);
  CHECK(origin[0] == "a: Div:float16, Mul:float16");
  const auto report = analyzer::analyze({analyzer::load_run(db)});
  const analyzer::Finding& o = overflow_origin_of(report);
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run a in FP32 (pinned"));
}

TEST_CASE("the model's own temperature that code reads through exp() is named, and bounded first",
          "[agent][code-after]") {
  TempDir dir;
  const std::string db = run_towers(dir, 11.5);
  const std::vector<std::string> read = event_details(db, "output-parameters");
  REQUIRE(read.size() == 1);
  CHECK_THAT(read[0], Catch::Matches("[ab]: logit_scale: 11\\.5 \\(float32, 1 value\\), read by Exp"));
  const auto report = analyzer::analyze({analyzer::load_run(db)});
  const analyzer::Finding& o = overflow_origin_of(report);
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Bound logit_scale before its exp()"));
}

TEST_CASE("the loss code is read once, with its numbers, as the run's first backward is about to start",
          "[agent][code-after]") {
  // As the Python agent's event: the analyzer reads it where no skip read the code.
  TempDir dir;
  const std::string db = run_code_after(dir, [](const torch::Tensor&, const torch::Tensor& b) {
    return torch::relu(b).to(torch::kFloat).pow(2).mean() * 1e6;
  });
  const std::vector<std::string> code = event_details(db, "loss-code-first");
  REQUIRE(code.size() == 1);
  CHECK(code[0] == "Relu:float16, ToCopy:float32, Pow(2):float32, Mean:float32, Mul(1e+06):float32");
}

TEST_CASE("a loss multiplied by a large number on top of the scaler has the factor taken out first",
          "[agent][code-after]") {
  TempDir dir;
  const std::string db = run_code_after(dir, [](const torch::Tensor&, const torch::Tensor& b) {
    return torch::relu(b).to(torch::kFloat).pow(2).mean() * 1e6;
  });
  const auto report = analyzer::analyze({analyzer::load_run(db)});
  const analyzer::Finding& o = overflow_origin_of(report);
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Take out the loss code's multiplication by 1e+06"));
}

namespace {

// exp() of b's outputs times 40 in fp16: Inf from the first step on, every probed output finite.
torch::Tensor exp_loss(const torch::Tensor&, const torch::Tensor& b) { return (b * 40).exp().mean().to(torch::kFloat); }

}  // namespace

TEST_CASE("the code of a loss gone NaN/Inf is read in its step, in eight steps a run at most", "[agent][code-after]") {
  TempDir dir;
  const std::string db = run_code_after(dir, exp_loss);
  std::vector<std::int64_t> steps;
  for (const auto& e : rundb::RunDbReader(db).events())
    if (e.kind == "loss-code") {
      CHECK(e.detail == "Mul(40):float16, Exp:float16, Mean:float16, ToCopy:float32");
      steps.push_back(e.step);
    }
  CHECK(steps == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
}

TEST_CASE("a finite loss's code is not read as a NaN/Inf loss's", "[agent][code-after]") {
  TempDir dir;
  CHECK(event_details(run_code_after(dir, nullptr), "loss-code").empty());
}

TEST_CASE("a loss whose fp16 exp() overflows gets the loss in FP32 and logsumexp, as a Python run's",
          "[agent][code-after]") {
  TempDir dir;
  const auto report = rule_checks::report_of(run_code_after(dir, exp_loss));
  const analyzer::Finding* f = rule_checks::find(report, "forward-nonfinite");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->evidence, Catch::Contains("the operations from the model's output to the loss (step 0): Mul (float16), "
                                          "Exp (float16), Mean (float16), ToCopy (float32)"));
  REQUIRE(f->suggestions.size() >= 2);
  CHECK_THAT(f->suggestions[0].summary, Catch::StartsWith("Mul, Exp and Mean ran in float16"));
  CHECK_THAT(f->suggestions[1].summary, Catch::StartsWith("exp() overflows above 88.7 in float32"));
}

namespace {

// The model's own code between a and b: exp() of a's outputs times 20, Inf in fp16.
torch::Tensor exp_between(const torch::Tensor& a) { return (a * 20).exp(); }

}  // namespace

TEST_CASE("the caller's code that made the NaN/Inf input a module only received is read, with its numbers",
          "[agent][code-after]") {
  TempDir dir;
  CHECK(event_details(run_code_after(dir, nullptr, exp_between), "input-code") ==
        std::vector<std::string>{"b: Mul(20):float16, Exp:float16"});
}

TEST_CASE("an exp() between two modules gets its argument bounded in FP32, in C++ too", "[agent][code-after]") {
  TempDir dir;
  const auto report = rule_checks::report_of(run_code_after(dir, nullptr, exp_between));
  const analyzer::Finding* f = rule_checks::find(report, "forward-nonfinite");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->evidence, Catch::Contains("the code that made b's input, read at step 0: Mul, Exp (all float16)"));
  REQUIRE_FALSE(f->suggestions.empty());
  CHECK_THAT(f->suggestions[0].summary, Catch::StartsWith("Bound what the model's own forward() passes to exp() "
                                                          "between a and b"));
  CHECK_THAT(f->suggestions[0].cpp, Catch::StartsWith("auto y = torch::exp(x.to(torch::kFloat).clamp_max(20));"));
}

namespace {

// Cross-entropy of b's outputs over 32 classes, every target ignored (-100) where `all_ignored`:
// a mean over no target, 0/0. Else valid targets, on b's outputs times 1e5 in fp16 (Inf logits).
torch::Tensor cross_entropy_loss(const torch::Tensor& b, bool all_ignored) {
  namespace F = torch::nn::functional;
  if (all_ignored) return F::cross_entropy(b.to(torch::kFloat), torch::full({64}, -100, torch::kLong));
  return F::cross_entropy((b * 1e5).to(torch::kFloat), torch::arange(64) % 32);
}

// The first "loss-code" of 24 steps whose loss is cross_entropy_loss(b, all_ignored), and the
// summaries of its report's forward-nonfinite fixes.
std::pair<std::string, std::vector<std::string>> cross_entropy_read(const TempDir& dir, bool all_ignored) {
  const std::string db = run_code_after(
      dir, [&](const torch::Tensor&, const torch::Tensor& b) { return cross_entropy_loss(b, all_ignored); });
  const std::vector<std::string> code = event_details(db, "loss-code");
  REQUIRE_FALSE(code.empty());
  const auto report = rule_checks::report_of(db);
  const analyzer::Finding* f = rule_checks::find(report, "forward-nonfinite");
  REQUIRE(f != nullptr);
  std::vector<std::string> fixes;
  for (const auto& s : f->suggestions) fixes.push_back(s.summary);
  return {code[0], fixes};
}

}  // namespace

TEST_CASE("a cross-entropy over targets all ignored is read as a mean over a weight of 0, and gets its fix",
          "[agent][code-after]") {
  TempDir dir;
  const auto [code, fixes] = cross_entropy_read(dir, true);
  CHECK_THAT(code, Catch::EndsWith("NllLoss(mean of 0):float32"));
  REQUIRE_FALSE(fixes.empty());
  CHECK_THAT(fixes[0], Catch::Contains("every target of the batch is ignore_index"));
}

TEST_CASE("a cross-entropy over real targets of logits overflowed in fp16 is not given the ignore_index fix",
          "[agent][code-after]") {
  TempDir dir;
  const auto [code, fixes] = cross_entropy_read(dir, false);
  CHECK_THAT(code, Catch::Contains("NllLoss(mean of 64):float32"));
  for (const auto& fix : fixes) CHECK_THAT(fix, !Catch::Contains("ignore_index:"));
}

