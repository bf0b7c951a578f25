// forward-nonfinite where the module's FP32 replay confirmed an fp16 overflow and the Python
// agent read the code the module runs after its submodules (event "module-code"): the
// evidence lists it, and where the FP32 output passed fp16's range, an exp() in it has its
// argument bounded first (a flow's coupling layer without tanh on its log-scale: bounded,
// its forward stays finite) and a sum is divided by its number of terms (a graph
// convolution's index_add_ over a hub's messages: averaged, it trains healthy; both in
// tests/scenarios/test_module_code.py).
#include <cstdio>
#include <utility>

#include "rule_test.h"

namespace {

// A graph layer c2 (with its Linear c2.lin) whose output overflows fp16 in every step, its
// FP32 replay finite up to `absmax`, and its own code `code` read at step 0.
Report graph_layer_run(const TempDir& dir, double absmax, const std::string& code) {
  RunFixture f(dir.file("run.db"), {"c2.lin.weight", "head.weight"});
  f.finite_replay("c2", absmax);
  for (int i = 0; i < 4; ++i) {
    if (i == 0 && !code.empty()) f.event("module-code", "c2: " + code);
    f.activation("c2.lin", false).activation("c2", true).activation("head", true).step(65536, 32768, 1000, {}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a sum in a module's own code whose FP32 output passed fp16's range is divided first", "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 107904.0, "Index:float16, IndexAdd:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK(fw.module == "c2");
  CHECK_THAT(fw.evidence, Catch::Contains("its own code after its submodules, read at step 0: Index, IndexAdd (all "
                                          "float16)"));
  REQUIRE(fw.suggestions.size() == 3);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Divide the sum in c2's own code (IndexAdd) by its number of "
                                                          "terms") &&
                                            Catch::Contains("reached 107904, beyond fp16's 65504"));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("index_add_(0, dst, m)"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Train in bfloat16"));
}

TEST_CASE("a sum in a module's own code whose FP32 output fits fp16 leaves the pin first", "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 30000.0, "Index:float16, IndexAdd:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::Contains("its own code after its submodules"));
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Run c2 in FP32"));
}

TEST_CASE("own code without a sum or an exp is listed and offers neither fix", "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 107904.0, "Mul:float16, Add:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::Contains("Mul, Add (all float16)"));
  for (const auto& s : fw.suggestions) {
    CHECK_THAT(s.summary, !Catch::Contains("Divide the sum"));
    CHECK_THAT(s.summary, !Catch::Contains("passes to exp()"));
  }
}

TEST_CASE("an exp in a module's own code whose FP32 output passed fp16's range has its argument bounded first",
          "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 4.72319e9, "Split:float16, Exp:float16, Mul:float32, Cat:float32");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.suggestions.size() == 3);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Bound what c2's own code passes to exp() (Exp): in FP32 c2's "
                                                          "output reached 4.72319e+09, beyond fp16's 65504"));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("s = torch.tanh(s)"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Train in bfloat16"));
}

TEST_CASE("an exp in a module's own code whose FP32 output fits fp16 leaves the pin first", "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 30000.0, "Split:float16, Exp:float16, Mul:float32");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Run c2 in FP32"));
}

TEST_CASE("a module's own code with an exp and a sum bounds the exponent before dividing the sum",
          "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 107904.0, "Exp:float16, Sum:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.suggestions.size() >= 2);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Bound what c2's own code passes to exp() (Exp)"));
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Divide the sum in c2's own code (Sum)"));
}

TEST_CASE("a module's sum over a reduction is averaged with mean()", "[rules][module-code]") {
  TempDir dir;
  const Report r = graph_layer_run(dir, 107904.0, "Sum:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("out = x.mean(dim)  # was x.sum(dim)"));
}

namespace {

// c2 makes NaN/Inf from finite inputs in FP32 too (replayed), its own code read as `code`.
Finding intrinsic_with_code(const std::string& code) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"c2.lin.weight", "head.weight"});
  f.replay("c2", "intrinsic");
  for (int i = 0; i < 4; ++i) {
    if (i == 0) f.event("module-code", "c2: " + code);
    f.activation("c2.lin", false).activation("c2", true).activation("head", true).step(65536, 32768, 1000, {}, kNaN);
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  return required(r, "forward-nonfinite");
}

}  // namespace

TEST_CASE("a module whose own exp() makes Inf in FP32 too has its argument bounded before the look at its code",
          "[rules][module-code]") {
  const Finding fw = intrinsic_with_code("Exp:float16, Mul:float32");
  CHECK(fw.module == "c2");
  CHECK_THAT(fw.title, Catch::Contains("even in FP32: its code"));
  CHECK_THAT(fw.evidence, Catch::Contains("its own code after its submodules, read at step 0: Exp (float16), Mul "
                                          "(float32)"));
  REQUIRE(fw.suggestions.size() == 2);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Bound what c2's own code passes to exp() (Exp): from finite "
                                                          "inputs c2's output holds NaN/Inf in FP32 too"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Look at c2's code"));
}

TEST_CASE("a large constant a module's own code multiplies by, without which its FP32 output fits fp16, is brought "
          "down first", "[rules][module-code]") {
  TempDir dir;  // a LoRA adapter: base(x) + lora_B(lora_A(x)) * 50000
  const Report r = graph_layer_run(dir, 207983.0, "Mul(50000):float16, Add:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::Contains("Mul, Add (all float16)"));
  REQUIRE(fw.suggestions.size() >= 2);
  CHECK_THAT(fw.suggestions[0].summary,
             Catch::StartsWith("Bring down the constant c2's own code multiplies by: the multiplication by 50000 (Mul) "
                               "multiplies its input by 50000, so every value above 1.31 passes fp16's 65504, and in "
                               "FP32 c2's output reached 207983, which without it would be about 4.16."));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("lora_alpha"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Train in bfloat16"));  // then c2 with the code after it
}

TEST_CASE("a small constant, or one without which the FP32 output still passes fp16, is not blamed", "[rules][module-code]") {
  TempDir dir;
  for (const auto& [absmax, code] : {std::pair<double, const char*>{207983.0, "Mul(8):float16, Add:float16"},
                                     {207983.0, "Mul(100):float16, Add:float16"},  // below 256: sqrt(d_model)'s range
                                     {1e11, "Mul(50000):float16, Add:float16"},
                                     {207983.0, "Div(2):float16, Add:float16"}}) {
    const Report r = graph_layer_run(dir, absmax, code);
    const Finding& fw = required(r, "forward-nonfinite");
    for (const auto& s : fw.suggestions) CHECK_THAT(s.summary, !Catch::Contains("Bring down the constant"));
    std::remove(dir.file("run.db").c_str());
  }
}

TEST_CASE("a module whose own rsqrt makes NaN in FP32 too has an eps under the root before the look at its code",
          "[rules][module-code]") {
  // A Llama RMSNorm with rms_norm_eps=0 on a padding token's zero embedding: rsqrt(0) is Inf.
  const Finding fw = intrinsic_with_code("Pow(2):float32, Mean:float32, Add:float32, Rsqrt:float32, Mul:float32");
  REQUIRE(fw.suggestions.size() == 2);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Keep what c2's own code takes the reciprocal square root of "
                                                          "(Rsqrt) off 0"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("torch.rsqrt(variance + self.eps)"));
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Look at c2's code"));
}

TEST_CASE("a module whose own code divides by a square root it takes has the root kept off 0", "[rules][module-code]") {
  const Finding fw = intrinsic_with_code("Pow(2):float32, Sum:float32, Sqrt:float32, Div:float32");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Keep what c2's own code takes the square root or norm of and "
                                                          "divides by (Sqrt) off 0"));
}

TEST_CASE("a root beside a log in a module's own code is left to the look at its code", "[rules][module-code]") {
  const Finding fw = intrinsic_with_code("Log:float32, Rsqrt:float32, Mul:float32");
  REQUIRE(fw.suggestions.size() == 1);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Look at c2's code"));
}
