// Evaluations between the training steps (eval mode, gradients off) whose output went
// NaN/Inf: the Python agent's event evaluation-output-nonfinite, "(not looked at)" for the
// first, then the first module whose output held NaN/Inf. Every training step is finite, and
// the report must not read healthy (tests/scenarios/test_evaluations.py runs the real loop).
#include "rule_test.h"

namespace {

// Four finite training steps, with an evaluation after steps 1 and 3 whose details are given;
// `intrinsic`: a module whose training replay made NaN/Inf from finite inputs in FP32 too.
Report evaluations(const std::vector<std::string>& details, const std::string& intrinsic = "-") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  if (intrinsic != "-") f.replay(intrinsic, "intrinsic");
  for (int i = 0; i < 4; ++i) {
    f.step(65536, 65536);
    if ((i == 1 || i == 3) && !details.empty() && std::size_t(i / 2) < details.size())
      f.event("evaluation-output-nonfinite", details[std::size_t(i / 2)]);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an evaluation that went NaN/Inf after finite training steps is a warning naming its first module",
          "[rules][evaluation]") {
  const Report r = evaluations({"(not looked at)", "encoder.1.mlp"});
  const Finding& f = required(r, "evaluation-overflow");
  CHECK(f.severity == Severity::kWarning);
  CHECK_FALSE(Gate("error").fails(r));
  CHECK(Gate("all").fails(r));
  CHECK(f.module == "encoder.1.mlp");
  CHECK(f.title == "Evaluations between the training steps went NaN/Inf, first in module encoder.1.mlp");
  CHECK_THAT(f.evidence, Catch::Contains("in 2 evaluations between the training steps (the model in eval mode, "
                                         "gradients off; at steps 2, 4)"));
  REQUIRE(f.suggestions.size() == 2);
  CHECK(f.suggestions[0].untried);
  CHECK_THAT(f.suggestions[0].python, Catch::StartsWith("ampdiag.pin_fp32(model.encoder[1].mlp)"));
  CHECK_THAT(f.suggestions[1].python, Catch::Contains("torch.no_grad(), torch.autocast(device_type=\"cpu\", "
                                                      "dtype=torch.bfloat16)"));
}

TEST_CASE("an evaluation's first module is titled with its type, so that a Sequential's index does not read as a step",
          "[rules][evaluation]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 4; ++i) {
    f.activation("0", false);
    f.step(65536, 65536);
    if (i == 1) f.event("evaluation-output-nonfinite", "(not looked at)");
    if (i == 3) f.event("evaluation-output-nonfinite", "0");
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(required(r, "evaluation-overflow").title ==
        "Evaluations between the training steps went NaN/Inf, first in module 0 (Module)");
}

TEST_CASE("an evaluation no other followed says to evaluate again to name the module, with no pin",
          "[rules][evaluation]") {
  const Report r = evaluations({"(not looked at)"});
  const Finding& f = required(r, "evaluation-overflow");
  CHECK(f.module.empty());
  CHECK_THAT(f.evidence, Catch::EndsWith("evaluate again with ampdiag attached to name the first module"));
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("Or evaluate without fp16"));
}

TEST_CASE("an evaluation whose modules all stayed finite is placed in the model's own forward()",
          "[rules][evaluation]") {
  const Report r = evaluations({"(not looked at)", ""});
  const Finding& f = required(r, "evaluation-overflow");
  CHECK(f.module.empty());
  CHECK_THAT(f.title, Catch::EndsWith("in the model's own forward(): every module's output was finite"));
}

TEST_CASE("an evaluation's NaN/Inf first at a module that makes them by design in training is information",
          "[rules][evaluation]") {
  // An all-masked row's softmax: NaN from finite inputs in FP32 too, as the training's replay found.
  const Report r = evaluations({"(not looked at)", "attn.mask"}, "attn.mask");
  const Finding& f = required(r, "evaluation-overflow");
  CHECK(f.severity == Severity::kInfo);
  CHECK(f.title == "Evaluations between the training steps went NaN/Inf in attn.mask, which makes NaN/Inf by design: "
                   "not fp16's");
  CHECK(f.suggestions.empty());
  CHECK_FALSE(Gate("all").fails(r));
}

TEST_CASE("a run without such evaluations has no evaluation finding", "[rules][evaluation]") {
  const Report r = evaluations({});
  CHECK(find(r, "evaluation-overflow") == nullptr);
  CHECK(r.findings.empty());
}
