// underflow on hand-built run.db fixtures: zeros and fp16 subnormals that a low loss scale
// makes, told apart from those no scale makes or lifts (a cancelled bias, exact zeros, a
// gradient the other layers leave no room to raise), and the fix each gets.
#include <algorithm>

#include "rule_test.h"

namespace {

// b.weight's gradient `zeros` exactly zero and `subnormal` fp16-subnormal (each step's L2 norm
// `b_l2` where given) beside the other layers' at a scaled abs-max of `absmax`, 10 steps at a
// scale of 65536; with the events `events` (kind, detail).
Report underflowing_b(const TempDir& dir, double zeros, double subnormal, double b_l2 = 0.0, double absmax = 1000.0,
                      const std::vector<std::pair<std::string, std::string>>& events = {}) {
  RunFixture f(dir.file("run.db"), kLayers);
  for (const auto& [kind, detail] : events) f.event(kind, detail);
  f.zeros_fraction("b.weight", zeros, subnormal);
  for (int i = 0; i < 10; ++i) {
    if (b_l2 > 0.0) f.clipped(b_l2, {"b.weight"});
    f.step(65536, 65536, absmax);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a layer whose gradient is mostly zero or fp16-subnormal is an underflow", "[rules]") {
  TempDir dir;
  const auto r = underflowing_b(dir, 0.6, 0.2);
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  CHECK(u->layer == "b.weight");
}


TEST_CASE("a layer of a module pinned to FP32 is not an underflow: no fp16 holds its gradient", "[rules]") {
  // A Mamba block pinned whole: its A_log and D gradients are small, and computed in FP32.
  TempDir dir;
  const auto r = underflowing_b(dir, 0.6, 0.2, 0.0, 1000.0, {{"pinned-fp32", "b"}});
  CHECK(find(r, "underflow") == nullptr);
}

TEST_CASE("a parameter whose gradient autocast computed in FP32 is not an underflow", "[rules]") {
  // A Mamba mixer's A_log: exp() of its float32 value, its gradient a float32 product (event
  // "fp32-gradients"), small at a low scale and flushed by nothing.
  TempDir dir;
  const auto r = underflowing_b(dir, 0.6, 0.2, 0.0, 1000.0, {{"fp32-gradients", "a.bias, b.weight"}});
  CHECK(find(r, "underflow") == nullptr);
}

TEST_CASE("an underflow's higher init_scale is not held down by a module pinned to FP32", "[rules]") {
  // a's gradients at 1000 scaled at 65536 would cap the scale at 2^22, but pinned they are
  // float32's: the cap is head's, where its gradients would pass 65504.
  // (Mostly subnormal: values a higher scale lifts, where exact zeros need 2^11 times it.)
  TempDir dir;
  const auto r = underflowing_b(dir, 0.1, 0.6, 0.0, 1000.0, {{"pinned-fp32", "a"}});
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.suggestions.front().summary, Catch::Contains("head.weight's recorded gradients"));
}

TEST_CASE("exact zeros many times the subnormals beside normal values are information, not an underflow", "[rules]") {
  // A saturated softmax's query and key gradients: 75% exactly zero, 9% subnormal, 16% normal.
  TempDir dir;
  const auto r = underflowing_b(dir, 0.75, 0.09);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.title, Catch::Contains("mostly exact zeros that the loss scale does not make"));
  CHECK(u.suggestions.empty());
}

TEST_CASE("exact zeros many times the subnormals beside more normal values than subnormal ones are information",
          "[rules]") {
  // A 3x3 depthwise kernel over a 1x1 map, eight of its nine taps on padding: 89% zero, 5%
  // subnormal, 6% normal.
  TempDir dir;
  const auto r = underflowing_b(dir, 0.89, 0.05);
  CHECK(required(r, "underflow").severity == Severity::kInfo);
}

TEST_CASE("exact zeros beside fewer normal values than subnormal ones stay an underflow", "[rules]") {
  TempDir dir;
  const auto r = underflowing_b(dir, 0.85, 0.1);
  CHECK(required(r, "underflow").severity == Severity::kWarning);
}

namespace {

// 20 steps of b.weight's gradient half exactly zero (dead units), `early_sub` subnormal in
// the first 6 and `late_sub` in the others.
Report zeros_with_early_subnormals(const TempDir& dir, double early_sub, double late_sub) {
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 20; ++i) {
    if (i == 0) f.zeros_fraction("b.weight", 0.5, early_sub);
    if (i == 6) f.zeros_fraction("b.weight", 0.5, late_sub);
    f.step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("exact zeros beside subnormals only in the first steps are information, not an underflow", "[rules]") {
  // TResNet's squeeze-excitation fc1 behind a zero-initialised norm: 47% subnormal at step 1,
  // 3% from step 10, half its values zero throughout behind dead units.
  TempDir dir;
  const auto r = zeros_with_early_subnormals(dir, 0.45, 0.03);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.evidence, Catch::StartsWith("over its later 10 sampled steps 50% of its values were exactly zero, 3% "
                                           "fp16-subnormal") &&
                             Catch::Contains("the subnormals were in its earlier steps"));
}

TEST_CASE("exact zeros beside subnormals that stay are still an underflow", "[rules]") {
  TempDir dir;
  const auto r = zeros_with_early_subnormals(dir, 0.45, 0.3);
  CHECK(required(r, "underflow").severity == Severity::kWarning);
}

TEST_CASE("an underflow's higher init_scale stops where another layer's gradients would pass fp16's top", "[rules]") {
  // Every other gradient at 1000 scaled at 65536: a scale above 65536 * 65504 / 1000 (2^22.03)
  // would make them Inf, and the scaler would back off to it anyway.
  TempDir dir;
  const auto r = underflowing_b(dir, 0.1, 0.6);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.suggestions.front().python, Catch::Contains("init_scale=2.0**22"));
  CHECK_THAT(u.suggestions.front().summary, Catch::Contains("up to 2**22: above it, a.weight's recorded gradients"));
}

namespace {

// b.weight underflowing at a scale of 4096 for 20 steps, beside a.weight's gradients at a
// scaled abs-max of 30000 for the five from `spike_from` and at 1 in the others.
Report underflow_beside_a_spike(const TempDir& dir, int spike_from) {
  RunFixture f(dir.file("run.db"), kLayers);
  f.zeros_fraction("b.weight", 0.1, 0.6).absmax_times("b.weight", 1e-3);
  for (int i = 0; i < 20; ++i) f.step(4096, 4096, i >= spike_from && i < spike_from + 5 ? 30000 : 1);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an underflow behind gradients that were large only at the run's start is told to let the scale grow back",
          "[rules]") {
  // MobileViT's first attention output: 6.7 unscaled at step 4, 4e-5 from step 15 on, which
  // left the scale at 4096 for torch's 2000 steps a doubling. Raising init_scale to what the
  // start allows changes nothing; a shorter growth_interval climbs to what the rest allows.
  TempDir dir;
  const Report r = underflow_beside_a_spike(dir, 0);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, Catch::Contains("the run's first steps, whose gradients were far larger, left the scale at "
                                         "4096: a.weight's before step 10 would pass 65504 above 2**13, those from then "
                                         "on only above 2**27"));
  REQUIRE_FALSE(u.suggestions.empty());
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Let the scale grow back sooner"));
  CHECK_THAT(u.suggestions.front().summary, Catch::Contains("up to 2**27 (above it, a.weight's gradients from step 10 "
                                                            "on would pass 65504)"));
  CHECK(u.suggestions.front().python == "scaler = torch.amp.GradScaler(\"cpu\", init_scale=2.0**12, growth_interval=200)");
}

TEST_CASE("gradients as large in the run's second half still bound the scale an underflow is told to reach", "[rules]") {
  TempDir dir;
  const Report r = underflow_beside_a_spike(dir, 12);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, !Catch::Contains("first steps"));
  REQUIRE_FALSE(u.suggestions.empty());
  CHECK_THAT(u.suggestions.front().summary, Catch::Contains("a higher init_scale (up to 2**13: above it, a.weight's "
                                                            "recorded gradients would pass 65504)"));
}

TEST_CASE("an underflow no loss scale lifts without another layer overflowing is not told to raise the scale",
          "[rules]") {
  // b's gradient: RMS 1e-7 at a scale of 65536. At 2^22, where a's gradients would pass
  // 65504, its RMS is 6.5e-6, a tenth of fp16's smallest normal: at most ~1% of its values
  // can reach the normal range (Chebyshev), so scaler settings cannot help.
  TempDir dir;
  const auto r = underflowing_b(dir, 0.6, 0.2, 64 * 1e-7);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.title, Catch::Contains("no loss scale lifts it without a.weight overflowing"));
  CHECK_THAT(u.evidence, Catch::Contains("at 2**22, the largest scale at which a.weight's recorded gradients stay"));
  REQUIRE(u.suggestions.size() == 1);
  CHECK_THAT(u.suggestions.front().summary, Catch::Contains("bfloat16"));
}

TEST_CASE("an underflow beside gradients already at fp16's top says the scale cannot double", "[rules]") {
  TempDir dir;
  const auto r = underflowing_b(dir, 0.6, 0.2, 0.0, 50000);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, Catch::Contains("the scale cannot double: a.weight's gradients already came within a factor "
                                         "of 1.31 of 65504"));
  for (const auto& s : u.suggestions) CHECK_THAT(s.python, !Catch::Contains("init_scale"));
}

TEST_CASE("zeros without any fp16-subnormal value are structural, not underflow", "[rules]") {
  TempDir dir;
  CHECK(underflowing_b(dir, 0.9, 0.0).healthy());  // dead units, masked rows: no value near the bottom of the range
}

TEST_CASE("an all-zero gradient (a layer the step did not use) is not underflow", "[rules]") {
  TempDir dir;
  CHECK(underflowing_b(dir, 1.0, 0.0).healthy());
}

TEST_CASE("underflow while an overflow holds the scale down says to fix the overflow first", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.zeros_fraction("b.weight", 0.6, 0.2);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"a.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  REQUIRE(u->suggestions.size() == 1);
  CHECK_THAT(u->suggestions.front().summary, Catch::Contains("Fix the overflow in a first"));
  const Finding* c = find(r, "scale-collapse");
  REQUIRE(c != nullptr);
  CHECK_THAT(c->suggestions.front().summary, Catch::Contains("Fix the overflow in a "));
}

namespace {

// A deep network's first layers: `n` weights whose gradients are 60 % zero and 20 %
// fp16-subnormal beside head.weight's, already within a factor of 1.31 of 65504.
Report vanishing(const TempDir& dir, int n) {
  std::vector<std::string> layers{"head.weight"};
  for (int i = 0; i < n; ++i) layers.push_back("blocks." + std::to_string(i) + ".weight");
  RunFixture f(dir.file("run.db"), layers);
  for (int i = 0; i < n; ++i) f.zeros_fraction("blocks." + std::to_string(i) + ".weight", 0.6, 0.2);
  for (int i = 0; i < 10; ++i) f.step(65536, 65536, 50000);
  f.finish();
  return report_of(dir.file("run.db"));
}

std::int64_t count_of(const Report& r, const std::string& rule) {
  return std::count_if(r.findings.begin(), r.findings.end(), [&](const Finding& f) { return f.rule == rule; });
}

}  // namespace

TEST_CASE("three or more underflows that the same layer leaves no scale to lift are one finding", "[rules]") {
  // A deep plain network's vanishing gradients gave 17 findings alike.
  TempDir dir;
  const Report r = vanishing(dir, 12);
  REQUIRE(count_of(r, "underflow") == 1);
  const Finding& u = required(r, "underflow");
  CHECK(u.title == u.layer + " and 11 more layers: most of their gradients are below fp16's normal range, and no loss "
                             "scale lifts them without head.weight overflowing");
  CHECK_THAT(u.evidence, Catch::EndsWith("and 3 more layers"));
  REQUIRE(u.suggestions.size() == 1);
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Train in bfloat16"));
}

namespace {

// The first `n` of three layers underflowing alike beside head.weight, 10 steps at 65536.
Report alike_underflows(const TempDir& dir, int n) {
  const std::vector<std::string> layers = {"head.weight", "l1.weight", "l2.weight", "l3.weight"};
  RunFixture f(dir.file("run.db"), layers);
  for (int i = 1; i <= n; ++i) f.zeros_fraction(layers[std::size_t(i)], 0.1, 0.6);
  for (int i = 0; i < 10; ++i) f.step(65536, 65536, 1000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("three or more underflows that the scale lifts with the same fix are one finding", "[rules]") {
  // MobileViT under a scale its start left at 4096: 34 such findings, each fix the same.
  TempDir dir;
  const Report r = alike_underflows(dir, 3);
  REQUIRE(count_of(r, "underflow") == 1);
  const Finding& u = required(r, "underflow");
  CHECK(u.title == "l1.weight and 2 more layers: most of their gradients are zero or below fp16's normal range at the "
                   "current scale");
  CHECK_THAT(u.evidence, Catch::EndsWith("; the same holds for l2.weight, l3.weight"));
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Let the scale grow"));
}

TEST_CASE("two underflows that the scale lifts with the same fix stay two findings", "[rules]") {
  TempDir dir;
  CHECK(count_of(alike_underflows(dir, 2), "underflow") == 2);
}

TEST_CASE("two underflows that the same layer leaves no scale to lift stay two findings", "[rules]") {
  TempDir dir;
  CHECK(count_of(vanishing(dir, 2), "underflow") == 2);
}

TEST_CASE("a weight's gradient far below its bias's is an underflow, not a bias cancelled to rounding", "[rules]") {
  // Taken on tiny inputs (a deep network's vanishing activations): the scale does flush it.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight", "fc.weight", "fc.bias"});
  f.zeros_fraction("fc.weight", 0.6, 0.2);
  for (int i = 0; i < 10; ++i) f.clipped(1e-4, {"fc.weight"}).step(65536, 65536);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& u = required(r, "underflow");
  CHECK(u.layer == "fc.weight");
  CHECK_THAT(u.title, !Catch::Contains("cancels to rounding"));
}

namespace {

// blk.weight's gradients `zeros` exactly zero and `subnormal` fp16-subnormal at a scale of
// 32768, beside head.weight's within a factor of 2.18 of 65504: room for 2**16 at most.
Report behind_a_small_gain(const TempDir& dir, double zeros, double subnormal) {
  RunFixture f(dir.file("run.db"), {"head.weight", "blk.weight"});
  f.zeros_fraction("blk.weight", zeros, subnormal).absmax_times("blk.weight", 1e-6);
  for (int i = 0; i < 10; ++i) f.step(32768, 32768, 30000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a gradient mostly flushed to exact zeros is not told to let the scale grow by the little room left",
          "[rules]") {
  // CaiT's attention weights behind a LayerScale of 1e-5: two thirds of their gradient exactly
  // zero at 32768; the head's gradients leave room for 65536, which lifts none of those zeros.
  TempDir dir;
  const Report r = behind_a_small_gain(dir, 0.67, 0.2);
  const Finding& u = required(r, "underflow");
  CHECK(u.title == "blk.weight: most of its gradient is below fp16's normal range, and no loss scale lifts it without "
                   "head.weight overflowing");
  CHECK_THAT(u.evidence, Catch::Contains("67% of its values were exactly zero, below 2^-25 at the scales they ran at "
                                         "(from 32768), and at 2**16, the largest scale at which head.weight's recorded "
                                         "gradients stay within 65504, they stay below fp16's normal range"));
  REQUIRE(u.suggestions.size() == 1);
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Train in bfloat16"));
}

TEST_CASE("a gradient mostly subnormal with the same little room is still told to let the scale grow", "[rules]") {
  TempDir dir;
  const Report r = behind_a_small_gain(dir, 0.3, 0.5);
  const Finding& u = required(r, "underflow");
  REQUIRE_FALSE(u.suggestions.empty());
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Let the scale grow"));
}

TEST_CASE("a gradient that underflowed at the largest scale the room allows is not told to let the scale grow",
          "[rules]") {
  // CaiT's attention projections: 80 % zero or subnormal at 65536, their run's first scale,
  // and after one skip at 32768, where the head's gradients leave room for 65536 only.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight", "blk.weight"});
  f.zeros_fraction("blk.weight", 0.3, 0.5).absmax_times("blk.weight", 1e-6);
  for (int i = 0; i < 5; ++i) f.step(65536, 65536, 60000);
  for (int i = 0; i < 5; ++i) f.step(32768, 32768, 30000);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.title, Catch::EndsWith("no loss scale lifts it without head.weight overflowing"));
  CHECK_THAT(u.evidence, Catch::Contains("it ran 5 sampled steps at 2**16 or above, the largest scale at which "
                                         "head.weight's recorded gradients stay within 65504, with 80% of its values "
                                         "still zero or fp16-subnormal there"));
  REQUIRE(u.suggestions.size() == 1);
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Train in bfloat16"));
}

namespace {

// blocks.1.attn.qkv.weight's gradients `zeros` exactly zero and `subnormal` fp16-subnormal, in a
// block with the per-channel factor `scale_name` (of shape `shape`, and module type `type`) at
// `value` per element.
Report behind_a_layer_scale(const TempDir& dir, const std::string& scale_name, const std::string& type, double value,
                            double zeros = 0.1, double subnormal = 0.7, std::vector<std::int64_t> shape = {64}) {
  RunFixture f(dir.file("run.db"), {"head.weight", "blocks.1.attn.qkv.weight", scale_name}, 0, 1, "float32",
               {{scale_name, type}}, {{scale_name, std::move(shape)}});
  f.zeros_fraction("blocks.1.attn.qkv.weight", zeros, subnormal);
  for (int i = 0; i < 10; ++i) f.weight_norm(scale_name, value * 8).step(65536, 65536, 1000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an underflow behind a small layer scale of its block names that scale", "[rules]") {
  // CaiT's blocks scale each branch by gamma_1 or gamma_2, 1e-5 per element at the start.
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.gamma_1", "Block", 1e-5);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, Catch::Contains("; its block scales its branch by blocks.1.gamma_1, a layer scale that "
                                         "started at about 1e-05 per element: the branch's gradients are about that "
                                         "much smaller until they grow"));
}

TEST_CASE("a LayerScale module beside the underflowing layer is its block's scale too", "[rules]") {
  // timm's ViT: blocks.1.ls1 (LayerScale) holds gamma, beside blocks.1.attn.
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.ls1.gamma", "LayerScale", 1e-5);
  CHECK_THAT(required(r, "underflow").evidence, Catch::Contains("its block scales its branch by blocks.1.ls1.gamma"));
}

TEST_CASE("a LayerScale2d's gamma, shaped to broadcast over a feature map, is its block's scale too", "[rules]") {
  // FastViT's RepMixer: token_mixer.layer_scale (LayerScale2d) holds gamma as [384, 1, 1].
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.ls.gamma", "LayerScale2d", 1e-5, 0.1, 0.7, {64, 1, 1});
  CHECK_THAT(required(r, "underflow").evidence, Catch::Contains("its block scales its branch by blocks.1.ls.gamma"));
}

TEST_CASE("a SkipInit gain of its block that starts at 0 is named as its branch's scale", "[rules]") {
  // DeepMind's NFNets in timm: each block multiplies its branch by skipinit_gain, a scalar at 0.
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.skipinit_gain", "NormFreeBlock", 0.0, 0.2, 0.7, {});
  CHECK_THAT(required(r, "underflow").evidence,
             Catch::Contains("; its block scales its branch by blocks.1.skipinit_gain, a gain on its branch that "
                             "started at 0: the branch's gradients start at zero and stay far smaller until it grows"));
}

TEST_CASE("another block's gamma held by CaiT's LayerScaleBlock is not the layer's scale", "[rules]") {
  // A LayerScaleBlock is a block holding its gammas, not a LayerScale module whose parent is
  // the block: blocks.0's gamma does not scale blocks.1's branches.
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.0.gamma_1", "LayerScaleBlock", 1e-5);
  CHECK_THAT(required(r, "underflow").evidence, !Catch::Contains("layer scale"));
}

TEST_CASE("a small gamma that is a matrix is no layer scale", "[rules]") {
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.gamma_1", "Block", 1e-5, 0.1, 0.7, {64, 64});
  CHECK_THAT(required(r, "underflow").evidence, !Catch::Contains("layer scale"));
}

TEST_CASE("a layer scale of its block that is not small is not named", "[rules]") {
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.gamma_1", "Block", 0.1);
  CHECK_THAT(required(r, "underflow").evidence, !Catch::Contains("layer scale"));
}

TEST_CASE("exact zeros behind a small layer scale are an underflow, not zeros in any precision", "[rules]") {
  // CaiT's qkv bias: the query and key thirds exactly zero (the branch scaled by 1e-5, flushed
  // by fp16), the value third in range.
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.gamma_1", "Block", 1e-5, 0.67, 0.02);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kWarning);
  CHECK_THAT(u.title, !Catch::Contains("exact zeros that the loss scale does not make"));
  CHECK_THAT(u.evidence, Catch::Contains("its block scales its branch by blocks.1.gamma_1"));
}

TEST_CASE("the same exact zeros beside a layer scale that is not small stay information", "[rules]") {
  TempDir dir;
  const Report r = behind_a_layer_scale(dir, "blocks.1.gamma_1", "Block", 0.1, 0.67, 0.02);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.title, Catch::Contains("exact zeros that the loss scale does not make"));
}

TEST_CASE("steps that left a layer unused at the largest scale the room allows are no try of that scale", "[rules]") {
  // A branch not taken at 65536 (an all-zero gradient), then mostly subnormal at 32768.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight", "blk.weight"});
  f.zeros_fraction("blk.weight", 1.0, 0.0).absmax_times("blk.weight", 1e-6);
  for (int i = 0; i < 5; ++i) f.step(65536, 65536, 60000);
  f.zeros_fraction("blk.weight", 0.3, 0.5);
  for (int i = 0; i < 5; ++i) f.step(32768, 32768, 30000);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& u = required(r, "underflow");
  REQUIRE_FALSE(u.suggestions.empty());
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Let the scale grow"));
}
