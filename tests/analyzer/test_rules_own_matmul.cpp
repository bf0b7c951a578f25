// forward-nonfinite: the model's own code that made a module's NaN/Inf input runs a matmul that
// autocast keeps in fp16 over a module's outputs above 256 (a recommender's interaction bmm
// over a table 3000 times too large): that module's outputs are brought down first, and the
// matmul in FP32 alone is said to hand its product on where torch's Linear takes it.
#include "rule_test.h"

namespace {

// A VAE-shaped run whose dec.0 only receives the NaN/Inf its input already held (its FP32
// replay NaN/Inf too), mu's outputs reaching `mu_absmax`, and the model's own code before
// dec.0 a Bmm in float16 (a recommender's feature interaction); dec.0 torch's Linear where
// `torch_linear`.
Report matmul_after_large_outputs(const TempDir& dir, double mu_absmax, bool torch_linear) {
  RunFixture f(dir.file("run.db"), {"mu.weight", "logvar.weight", "dec.0.weight"});
  f.weight_norm("mu.weight", 64.0 * 3000.0);  // [64, 64]: RMS 3000
  if (torch_linear) f.module_type("dec.0", "Linear").module_source("dec.0", "/torch/nn/modules/linear.py:50");
  f.replay("dec.0", "nonfinite").replay("dec", "nonfinite");
  for (int i = 0; i < 4; ++i) {
    if (i == 0) f.event("input-code", "dec.0: Stack:float32, ToCopy:float16, Bmm:float16, Cat:float32");
    f.activation("mu", false, mu_absmax).activation("logvar", false).activation("dec.0", true).activation("dec", true)
        .step(65536, 32768, 1000, {"dec.0.weight"}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("the model's own matmul in float16 over outputs above 256 names the module that makes them",
          "[rules][replay]") {
  TempDir dir;
  const Report r = matmul_after_large_outputs(dir, 18611.0, true);
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.suggestions.size() >= 2);
  CHECK_THAT(fw.suggestions[0].summary,
             Catch::StartsWith("Bring mu's outputs down: they reach 1.86e+04, above 256, and the model's own forward() "
                               "multiplies them between logvar and dec.0 in Bmm") &&
                 Catch::Contains("mu.weight's RMS is 3e+03") &&
                 Catch::EndsWith("Computing the Bmm in FP32 alone would hand its product on to dec.0 (Linear), which "
                                 "autocast runs in float16 too."));
  CHECK(fw.suggestions[0].python.empty());
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0"));
}

TEST_CASE("the model's own matmul in float16 before a module of the user's own may run in FP32", "[rules][replay]") {
  TempDir dir;
  const Report r = matmul_after_large_outputs(dir, 18611.0, false);
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::Contains("Or compute the Bmm in FP32"));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("y = a.float() @ b.float()  # was the Bmm of a and b under "
                                                      "autocast, in float16"));
}

TEST_CASE("the model's own matmul in float16 over small outputs keeps the look at that code first", "[rules][replay]") {
  TempDir dir;
  const Report r = matmul_after_large_outputs(dir, 10.0, true);
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0"));
}
