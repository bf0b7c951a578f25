// forward-nonfinite in the loss code: a constant's product is the overflow's reason only where
// what it multiplies can pass the range; else the float16 matmuls after it are named.
#include "rule_test.h"

namespace {

// A perceptual loss on images in [0, 255]: the model's output times 255, a frozen network's
// convolutions and a Gram matrix over each feature map, all under autocast.
const std::string kGramLoss = "Mul(255):float16, Convolution:float16, Relu:float16, View:float16, Transpose:float16, "
                              "Bmm:float16, ToCopy:float32, MseLoss:float32";

// The forward-nonfinite finding of a run whose loss went NaN at step 1 after `code`, the
// model's only probed module having made outputs up to `output_absmax`.
Finding nan_loss_after_outputs(const std::string& code, double output_absmax) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false, output_absmax).step(65536, 65536);
  f.event("loss-code", code).activation("enc", false, output_absmax).step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  return *fw;
}

}  // namespace

TEST_CASE("a constant's product that keeps the outputs in range gives way to the matmuls", "[rules][loss-code]") {
  const Finding fw = nan_loss_after_outputs(kGramLoss, 2.4);  // 2.4 * 255 = 612
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions.front().summary,
             Catch::StartsWith("Convolution and Bmm ran in float16 whatever their inputs' dtype, and each value they "
                               "make sums many products"));
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains(".float()"));
  for (const Suggestion& s : fw.suggestions) CHECK_THAT(s.summary, !Catch::Contains("multiplication by 255"));
}

TEST_CASE("a constant's product that takes the outputs past the range is named", "[rules][loss-code]") {
  const Finding fw = nan_loss_after_outputs(kGramLoss, 300.0);  // 300 * 255 = 76500
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions.front().summary, Catch::Contains("the multiplication by 255 (Mul) multiplies its input by 255"));
}

TEST_CASE("a constant's product after an operation that computes is named", "[rules][loss-code]") {
  // What the matmul made, not the model's output, is what it multiplies.
  const Finding fw = nan_loss_after_outputs("Mm:float16, Mul(255):float16, ToCopy:float32, MseLoss:float32", 2.4);
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions.front().summary, Catch::Contains("the multiplication by 255 (Mul)"));
}

TEST_CASE("a float16 target beside a loss code's own fp16 matmuls clears the model only", "[rules][loss-code]") {
  // A style loss whose style Grams were made under autocast (Inf) beside the generated
  // image's own Grams, whose Bmm runs in fp16 as well.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false, 2.4).step(65536, 65536);
  f.event("loss-code", kGramLoss)
      .event("loss-input-nonfinite", "MseLoss target: 0 NaN, 3 Inf of 64 values, float16")
      .activation("enc", false, 2.4)
      .step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.title, Catch::EndsWith("a float16 tensor made outside the model: not the model"));
  REQUIRE(fw.suggestions.size() == 3);
  CHECK_THAT(fw.suggestions[2].summary, Catch::StartsWith("Once MseLoss's target is mended, the loss code's own "
                                                          "Convolution and Bmm run in float16 too"));
}
