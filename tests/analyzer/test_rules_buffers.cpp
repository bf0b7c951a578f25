// A module that makes NaN from finite inputs in FP32 too because of what its buffers hold
// (event buffers-nan): a checkpoint's NaN, or an Inf a training step wrote into them.
#include "rule_test.h"

namespace {

// 12 steps halving the scale from 65536, each with `vq`'s output NaN/Inf after enc's finite
// one, its replay intrinsic and event buffers-nan `buffers` ("vq: codebook (...)"): the
// forward-nonfinite finding's first fix.
Suggestion inf_buffers_fix(const std::string& vq, const std::string& buffers) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "dec.weight"});
  f.replay(vq, "intrinsic").event("buffers-nan", buffers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("enc", false).activation(vq, true).step(scale, scale / 2, 1000, {"dec.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  return fw.suggestions.front();
}

}  // namespace

TEST_CASE("a module whose buffers held NaN when its replay made NaN is named for them, with a reset", "[rules][replay]") {
  // A frozen BatchNorm whose running variance a checkpoint left NaN.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"conv.weight", "bn.weight", "head.weight"});
  f.replay("bn", "intrinsic").event("buffers-nan", "bn: running_var (1 of 8 values NaN)");
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("conv", false).activation("bn", true).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "bn");
  CHECK_THAT(fw->title, Catch::Contains("because its buffers hold NaN"));
  CHECK_THAT(fw->evidence, Catch::EndsWith("its buffers held NaN: running_var (1 of 8 values NaN)"));
  CHECK(fw->suggestions.front().python == "model.bn.reset_running_stats()");
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK_THAT(collapse->suggestions.front().summary, Catch::StartsWith("Fix the NaN/Inf made in bn (see forward-nonfinite)"));
}

TEST_CASE("another buffer holding NaN is named for the user to restore", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"norm.weight", "head.weight"});
  f.replay("norm", "intrinsic").event("buffers-nan", "norm: scale (2 of 64 values NaN)");
  for (int i = 0; i < 4; ++i) f.activation("norm", true).step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Restore norm's buffers (scale (2 of 64 values NaN))"));
}

TEST_CASE("a buffer that training wrote Inf into is updated in FP32: the module's pin", "[rules][replay]") {
  // A VQ-VAE's EMA codebook whose update autocast ran in float16: finite at attach(), Inf
  // from step 1, and every output after it NaN/Inf.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "dec.weight"});
  f.replay("vq", "intrinsic")
      .event("buffers-nan", "vq: codebook (float32: 7 of 2048 values Inf, finite at attach())");
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("enc", false).activation("vq", true).step(scale, scale / 2, 1000, {"dec.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "vq");
  CHECK(fw->title == "vq makes NaN/Inf from finite inputs because training wrote Inf into its buffers");
  CHECK_THAT(fw->evidence, Catch::Contains("in FP32 too, from the Inf that training wrote into its buffers"));
  CHECK_THAT(fw->evidence, !Catch::Contains("so fp16's range is not the cause"));
  CHECK_THAT(fw->evidence, Catch::EndsWith("did not hold at attach(): codebook (float32: 7 of 2048 values Inf, finite at attach())"));
  REQUIRE_FALSE(fw->suggestions.empty());
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Update vq's buffers in FP32: run vq in FP32"));
  CHECK_THAT(fw->suggestions.front().summary, Catch::Contains("a float32 buffer reaches Inf only past 3.4e38"));
  CHECK_THAT(fw->suggestions.front().python, Catch::StartsWith("ampdiag.pin_fp32(model.vq)"));
}

TEST_CASE("a float16 buffer that training wrote Inf into is stored in float32, not only pinned", "[rules][replay]") {
  // An EMA kept in a float16 buffer: autocast off around the module still adds into float16,
  // so the fix names the buffers to keep in float32 before the pin.
  const Suggestion fix = inf_buffers_fix(
      "enc.vq",
      "enc.vq: codebook (float16: 7 of 2048 values Inf, finite at attach()), usage (float32: 1 of 64 values Inf, finite "
      "at attach()), ema (bfloat16: 2 NaN and 3 Inf of 64 values, finite at attach())");
  CHECK_THAT(fix.summary, Catch::StartsWith("Keep enc.vq's float16 buffers in float32 (codebook) and run enc.vq in FP32"));
  CHECK_THAT(fix.summary, Catch::Contains("pinning it alone cannot help"));
  CHECK_THAT(fix.python, Catch::StartsWith("model.enc.vq.codebook = model.enc.vq.codebook.float()"));
  CHECK_THAT(fix.python, !Catch::Contains("ema ="));
  CHECK_THAT(fix.python, !Catch::Contains("usage"));
  CHECK_THAT(fix.python, Catch::Contains("\nampdiag.pin_fp32(model.enc.vq)"));
  CHECK_THAT(fix.cpp, Catch::Contains("named_buffers(false)[\"codebook\"]; b.set_data(b.to(at::kFloat));"));
}

TEST_CASE("a bfloat16 buffer that training wrote Inf into gets the pin alone: it has float32's range", "[rules][replay]") {
  // Its Inf came from a float16 value (the update's matmul under autocast): computed in FP32,
  // the same update fits a bfloat16 buffer.
  const Suggestion fix = inf_buffers_fix("vq", "vq: ema (bfloat16: 3 of 64 values Inf, finite at attach())");
  CHECK_THAT(fix.summary, Catch::StartsWith("Update vq's buffers in FP32: run vq in FP32"));
  CHECK_THAT(fix.summary, Catch::Contains("a float32 or bfloat16 buffer reaches Inf only past 3.4e38"));
  CHECK_THAT(fix.summary, !Catch::Contains("cannot help"));
  CHECK_THAT(fix.python, Catch::StartsWith("ampdiag.pin_fp32(model.vq)"));
}
