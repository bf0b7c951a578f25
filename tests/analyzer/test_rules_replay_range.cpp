// A module whose FP32 replay was finite but beyond fp16's range: fp16 is confirmed as the
// cause, yet pinned alone it hands its FP32 output to the code that uses it, which overflows
// there instead where it runs in fp16 (timm's ViT with a hot mlp.fc1: pinned, the Inf moves
// to fc2), and not where it runs in float32 (T5's wo before a float32 residual sum).
#include "rule_test.h"

namespace {

// A ViT block whose mlp.fc1 overflows fp16 in every step, its replay finite up to `absmax`.
Report hot_fc1(const TempDir& dir, double absmax) {
  RunFixture f(dir.file("run.db"), {"blocks.2.mlp.fc1.weight", "blocks.2.mlp.fc2.weight"});
  f.finite_replay("blocks.2.mlp.fc1", absmax);
  for (int i = 0; i < 4; ++i)
    f.activation("blocks.2.mlp.fc1", true).activation("blocks.2.mlp.fc2", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a module whose FP32 output is beyond fp16's range gets its parent pinned, not itself", "[rules][replay]") {
  TempDir dir;
  const Report r = hot_fc1(dir, 281698.0);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "blocks.2.mlp.fc1");
  CHECK(fw->confirmation == "confirmed");
  CHECK_THAT(fw->evidence, Catch::Contains("finite but up to 281698, beyond fp16's largest value (65504)"));
  REQUIRE(fw->suggestions.size() == 2);
  CHECK_THAT(fw->suggestions[0].summary, Catch::StartsWith("Run blocks.2.mlp in FP32, blocks.2.mlp.fc1 with what uses its output"));
  CHECK_THAT(fw->suggestions[0].python, Catch::StartsWith("ampdiag.pin_fp32(model.blocks[2].mlp)"));
  CHECK_THAT(fw->suggestions[1].summary, Catch::StartsWith("Or train in bfloat16"));
}

TEST_CASE("the parent's pin says the module alone is enough where the code using its output runs in float32",
          "[rules][replay]") {
  TempDir dir;
  const Report r = hot_fc1(dir, 281698.0);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->suggestions[0].summary,
             Catch::EndsWith("blocks.2.mlp.fc1 pinned alone hands its FP32 output, beyond fp16's range, to the code "
                             "that uses it: enough where that code runs in float32 (a float32 residual sum), an "
                             "overflow there where it runs in fp16 (a Linear under autocast)."));
}

TEST_CASE("a parent pinned where no replay ran is not marked confirmed by replay", "[rules][replay]") {
  TempDir dir;
  const std::string text = render_text(hot_fc1(dir, 281698.0), Gate("error"));
  CHECK_THAT(text, Catch::Contains("Run blocks.2.mlp in FP32"));
  CHECK_THAT(text, !Catch::Contains("(confirmed by replay)"));
}

TEST_CASE("a module whose FP32 output fits fp16 is pinned itself, confirmed by replay", "[rules][replay]") {
  TempDir dir;
  const Report r = hot_fc1(dir, 60000.0);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("its output was finite (max |x| 60000)"));
  CHECK_THAT(fw->suggestions.front().python, Catch::StartsWith("ampdiag.pin_fp32(model.blocks[2].mlp.fc1)"));
  CHECK_THAT(render_text(r, Gate("error")), Catch::Contains("(confirmed by replay)"));
}

TEST_CASE("a top-level module whose FP32 output is beyond fp16's range gets bf16 first", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight"});
  f.finite_replay("head", 1e6);
  for (int i = 0; i < 4; ++i) f.activation("head", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  REQUIRE(fw->suggestions.size() == 2);
  CHECK_THAT(fw->suggestions[0].summary, Catch::StartsWith("Train in bfloat16"));
  CHECK_THAT(fw->suggestions[1].summary, Catch::StartsWith("Or run head in FP32 together with the code that uses its output"));
}

TEST_CASE("an overflow beyond fp16's range after a mask's -inf gets its parent pinned", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"attn.qkv.weight", "mlp.fc1.weight"});
  f.replay("attn.mask", "intrinsic").finite_replay("mlp.fc1", 2e5);
  for (int i = 0; i < 3; ++i) f.activation("attn.mask", true).activation("mlp.fc1", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "mlp.fc1");
  CHECK_THAT(fw->suggestions.front().python, Catch::StartsWith("ampdiag.pin_fp32(model.mlp)"));
}

namespace {

// A Python agent's run where `module` overflows fp16 in forward, its FP32 replay finite
// beyond fp16's range; the modules in `ran` ran too (after it in forward order).
Report hot_in(const TempDir& dir, const std::string& module, const std::vector<std::string>& ran) {
  RunFixture f(dir.file("run.db"), {module + ".weight"});
  f.meta("source", "ampdiag Python agent");
  f.finite_replay(module, 235892.0);
  for (int i = 0; i < 4; ++i) {
    f.activation(module, true);
    for (const auto& m : ran) f.activation(m, true);
    f.step(65536, 32768, 1000, {}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("the pin goes to the nearest module above that ran, past a ModuleDict that has no forward",
          "[rules][replay]") {
  // PEFT's lora_B.default sits in the ModuleDict lora_B; the LoRA Linear v_proj calls it.
  TempDir dir;
  const Report r = hot_in(dir, "attn.v_proj.lora_B.default", {"attn.v_proj", "attn"});
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.suggestions[0].summary,
             Catch::StartsWith("Run attn.v_proj in FP32, attn.v_proj.lora_B.default with what uses its output"));
}

TEST_CASE("a module under a ModuleList with nothing above it that ran is not told to pin the list",
          "[rules][replay]") {
  TempDir dir;
  const Report r = hot_in(dir, "layers.3", {});
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.suggestions.size() == 2);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Train in bfloat16"));
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Or run layers.3 in FP32 together with the code"));
}
