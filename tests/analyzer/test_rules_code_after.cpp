// overflow-origin where NaN/Inf gradients reach a module through its output and no module
// given that output sent them, with what the Python agent read of the code after it (events
// "output-code", "output-code-origin", "output-parameters"): an operation autocast keeps in
// fp16 between the module's output and the one whose backward made the NaN/Inf leaves only
// that code in FP32 as the fix, none leaves the module's pin first, and a parameter of the
// model's own read through exp() past CLIP's bound is clamped first.
#include "rule_test.h"

namespace {

constexpr const char* kSimilarities =
    "Div:float16, Mm:float16, Mul:float16, ToCopy:float32, LogSoftmax:float32, NllLoss(mean):float32";

// 12 skipped steps halving the scale from 65536, dec's gradients finite and enc's the first
// NaN/Inf ones each time; at the third, the agent saw NaN/Inf reach enc's output and read the
// code after it, `code` ("output-code"), and `parameters` ("output-parameters", if any); at
// the fourth, `origin` ("output-code-origin", if any). `place`: where that code runs
// ("output-code-place", if any).
Report code_after_run(const std::string& origin, const std::string& parameters = "",
                      const std::vector<std::string>& pinned = {}, const std::string& code = kSimilarities,
                      const std::string& place = "") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"dec.weight", "enc.weight"});
  for (const auto& path : pinned) f.event("pinned-fp32", path);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    if (i == 2) {
      f.event("output-code", "enc: " + code);
      if (!parameters.empty()) f.event("output-parameters", "enc: " + parameters);
      if (!place.empty()) f.event("output-code-place", "enc: " + place);
      f.event("module-output-gradient", "enc: nonfinite");
    }
    if (i == 3 && !origin.empty()) f.event("output-code-origin", "enc: " + origin);
    f.finite_first({"dec.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an overflow made after a matmul autocast keeps in fp16 is fixed by that code in FP32, not by the pin",
          "[rules][code-after]") {
  // A two-tower model's similarities, z_a @ z_b.T times a temperature: pinned, enc's output
  // is float32, and autocast still runs the matmul, and the Mul after it, in fp16.
  const Report r = code_after_run("Div:float16, Mm:float16, Mul:float16");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("that code, read at step 2: Div (float16), Mm (float16), Mul (float16), "
                                         "ToCopy (float32)"));
  CHECK_THAT(o.evidence, Catch::Contains("at step 3 Mul (float16) was the first of it whose backward sent NaN/Inf "
                                         "back from finite gradients, after Div, Mm (all float16)"));
  REQUIRE(o.suggestions.size() == 2);
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Run the code that uses enc's output in FP32: Mul's fp16 backward made "
                               "the NaN/Inf, after Mm, which autocast runs in fp16 whatever the inputs' dtype, so "
                               "pinning enc alone leaves it in fp16"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains("bfloat16"));
}

TEST_CASE("an overflow made in the matmul's own backward names it as the operation autocast keeps in fp16",
          "[rules][code-after]") {
  const Report r = code_after_run("Div:float16, Mm:float16");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::Contains("Mm's fp16 backward made the NaN/Inf, and autocast runs Mm in "
                                                       "fp16 whatever the inputs' dtype"));
}

TEST_CASE("an overflow made before any operation autocast keeps in fp16 keeps the module's pin first",
          "[rules][code-after]") {
  // A VAE's gain on its encoder's output, then the KL's exp() of the log-variance: pinned,
  // both follow the encoder's float32 output.
  const Report r = code_after_run("Mul:float16, Split:float16, Exp:float16", "", {},
                                  "Mul:float16, Split:float16, Exp:float16, Addmm:float16, ToCopy:float32");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc in FP32 (pinned: its output, and the gradient") &&
                                           Catch::EndsWith("Exp's backward made them in fp16, and pinned, it follows "
                                                           "enc's float32 output."));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Or run the code that uses enc's output in FP32"));
}

TEST_CASE("code after the module read without its origin traced leaves the pin first and the code in FP32 conditional",
          "[rules][code-after]") {
  const Report r = code_after_run("");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("that code, read at step 2: Div (float16), Mm (float16)"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc in FP32 (pinned: its output, and the gradient"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Where that code runs a matmul or another operation"));
}

TEST_CASE("a pinned module whose code after it overflows after a matmul in fp16 is told to run that code in FP32",
          "[rules][code-after]") {
  const Report r = code_after_run("Div:float16, Mm:float16, Mul:float16", "", {"enc"});
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("enc already ran in FP32 (pinned), so pinning it is no fix"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run the code that uses enc's output in FP32: "
                                                         "Mul's fp16 backward made the NaN/Inf"));
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::Contains("Run enc in FP32"));
}

TEST_CASE("a parameter of the model's own read through exp() past CLIP's bound is clamped first",
          "[rules][code-after]") {
  // CLIP's logit_scale at 11.5: exp() makes a factor of ~98716 on the similarities, and on
  // the gradient their fp16 backward sends back.
  const Report r = code_after_run("Div:float16, Mm:float16, Mul:float16",
                                  "logit_scale: 11.5 (float32, 1 value), read by Exp");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("it reads the model's own logit_scale: 11.5 (float32, 1 value), read by Exp"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Bound logit_scale before its exp(): the code after enc reads "
                                                         "it through exp(), and at 11.5 exp() gives 9.87e+04, which "
                                                         "enlarges the gradient"));
  // The same clamp as for a temperature whose exp() overflows the forward (model-parameters).
  CHECK_THAT(o.suggestions[0].python, Catch::Contains("scale = self.logit_scale.clamp(max=math.log(100)).exp()") &&
                                          Catch::Contains("model.logit_scale.clamp_(max=math.log(100))"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Run the code that uses enc's output in FP32"));
}

TEST_CASE("a temperature read through exp() within CLIP's bound is not told to be clamped", "[rules][code-after]") {
  const Report r = code_after_run("Div:float16, Mm:float16, Mul:float16",
                                  "logit_scale: 4.605 (float32, 1 value), read by Exp");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("Bound logit_scale"));
}

TEST_CASE("code after the module that only the loss runs is fixed where the loss is computed", "[rules][code-after]") {
  // A two-tower model that returns its embeddings; the loop's loss takes their similarities.
  const Report r = code_after_run("Div:float16, Mm:float16, Mul:float16", "", {}, kSimilarities, "loss");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("the code that uses enc's output (the loss, which takes enc's output as the "
                                         "model's) made them"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run the loss code that uses enc's output in FP32: Mul's fp16 "
                                                         "backward made the NaN/Inf"));
  CHECK_THAT(o.suggestions[0].python, Catch::StartsWith("# where the loss is computed, around the code that uses enc's "
                                                        "output:"));
}

TEST_CASE("code after the module in the model's forward() is fixed there", "[rules][code-after]") {
  // Hugging Face's CLIPModel computes its loss in its own forward().
  const Report r = code_after_run("Div:float16, Mm:float16, Mul:float16", "", {}, kSimilarities, "model");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("the code that uses enc's output (the model's own forward() after it) made them"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run the model's own code that uses enc's output in FP32"));
  CHECK_THAT(o.suggestions[0].python, Catch::StartsWith("# in the model's forward(), around the code that uses enc's "
                                                        "output:"));
}

TEST_CASE("an overflow made by a product with a large constant after the module lowers that constant first",
          "[rules][code-after]") {
  // PEFT's LoRA at lora_alpha 4e5 over r 8: lora_B's output times 50000 in its layer's forward().
  const Report r = code_after_run("Mul(50000):float16", "", {}, "Mul(50000):float16, Add:float16, ToCopy:float32");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Bring down the constant the code that uses enc's output multiplies by: the "
                               "multiplication by 50000 (Mul)") &&
                 Catch::Contains("its backward multiplies the gradient it sends back into enc by as much"));
  CHECK_THAT(o.suggestions[0].python, Catch::Contains("lora_alpha"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Run enc in FP32"));
}

TEST_CASE("a product with a parameter of the model's own read through exp() is not told to lower a constant",
          "[rules][code-after]") {
  const Report r = code_after_run("Div:float16, Mm:float16, Mul(98715.8):float16",
                                  "logit_scale: 11.5 (float32, 1 value), read by Exp");
  for (const auto& s : required(r, "overflow-origin").suggestions)
    CHECK_THAT(s.summary, !Catch::StartsWith("Bring down the constant"));
}

namespace {

// 12 skips halving the scale from 65536 to 16, enc's gradients the first NaN/Inf ones and the
// gradient reaching its output NaN/Inf at the third; then 4 steps applied at 16 in which
// other.weight's gradient, outside enc, reaches `other_unscaled` unscaled.
Report collapsed_beside(double other_unscaled) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"other.weight", "enc.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    if (i == 2) f.event("module-output-gradient", "enc: nonfinite");
    f.finite_first({"other.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  f.absmax_times("other.weight", other_unscaled * 16.0 / 1000.0);
  for (int i = 0; i < 4; ++i) f.step(16, 16);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an overflow made after a module beside another layer's gradients beyond 65504 / 128 offers no pin of it",
          "[rules][code-after]") {
  // A RealNVP flow on unnormalised data: its last coupling's scale net pinned, the gradients of
  // an earlier coupling's (up to 584 unscaled) held the scale at 64 all the same.
  const Report r = collapsed_beside(600.0);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.severity == Severity::kError);
  CHECK_THAT(o.evidence, Catch::Contains("; other layers' unscaled gradients were beyond 65504 / 128 too (other.weight "
                                         "up to 600), so pinning enc alone would leave the scale below the floor"));
  REQUIRE(o.suggestions.size() == 1);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Train in bfloat16"));
}

TEST_CASE("an overflow made after a module beside gradients that fit above the floor keeps its pin first",
          "[rules][code-after]") {
  const Report r = collapsed_beside(100.0);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, !Catch::Contains("other layers' unscaled gradients"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc in FP32"));
}
