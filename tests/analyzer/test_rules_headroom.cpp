// low-headroom on hand-built run.db fixtures: a layer near fp16's largest value matters only
// where it holds the scale down while another underflows, and a gradient that fp16's top
// does not bound (an FP32 sum: CLIP's logit_scale, an embedding, a LayerNorm's weight) holds
// nothing down at all.
#include "rule_test.h"

#include <algorithm>

namespace {

// A scale settled at 1024 after one overflow from 65536, every layer's gradient at 50000;
// b.weight mostly zero or subnormal where `underflow` (`zeros` exactly zero, `subnormal`
// fp16-subnormal).
Report settled_near_top(bool underflow, double zeros = 0.6, double subnormal = 0.2) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  if (underflow) f.zeros_fraction("b.weight", zeros, subnormal);
  f.step(65536, 1024, 50000, {"a.weight"});
  for (int i = 0; i < 10; ++i) f.step(1024, 1024, 50000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a layer near the fp16 maximum holding the scale where another underflows has low headroom", "[rules]") {
  const auto r = settled_near_top(true);
  const Finding* h = find(r, "low-headroom");
  REQUIRE(h != nullptr);
  CHECK(h->severity == Severity::kWarning);
  CHECK_THAT(h->evidence, Catch::Contains("b.weight underflows"));
  CHECK_THAT(h->suggestions.front().python, Catch::Contains("pin_fp32"));
}

TEST_CASE("a layer near the fp16 maximum while nothing underflows is information without a fix", "[rules]") {
  // A scaler settled below init_scale always has such a layer: the scale it allows loses
  // nothing, so there is nothing to pin.
  const auto r = settled_near_top(false);
  const Finding* h = find(r, "low-headroom");
  REQUIRE(h != nullptr);
  CHECK(h->severity == Severity::kInfo);
  CHECK(h->suggestions.empty());
  CHECK_THAT(h->evidence, Catch::Contains("no layer underflows"));
}

TEST_CASE("a layer near the fp16 maximum beside a gradient that no scale changes is information", "[rules]") {
  // b.weight's zeros are exact, far more than its subnormals: an informational underflow
  // finding, which a higher scale would not change, so the limit costs nothing either.
  const auto r = settled_near_top(true, 0.75, 0.09);
  const Finding& h = required(r, "low-headroom");
  CHECK(h.severity == Severity::kInfo);
  CHECK(h.suggestions.empty());
}

TEST_CASE("a layer that holds the scale below the floor is not said to cost nothing", "[rules]") {
  // Large true gradients (unnormalised regression targets): the scale settles at 64, where
  // nothing underflows, but scale-collapse calls a scale below 128 a collapse.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (double scale = 65536; scale > 64; scale /= 2) f.step(scale, scale / 2, 60000, {"head.weight"});
  for (int i = 0; i < 12; ++i) f.step(64, 64, 60000);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE(find(r, "scale-collapse") != nullptr);
  const Finding& h = required(r, "low-headroom");
  CHECK_THAT(h.evidence, Catch::Contains("no layer underflows at that scale yet, though it is below the floor of 128"));
  CHECK_THAT(h.evidence, !Catch::Contains("costs nothing"));
}

TEST_CASE("a finite gradient far beyond fp16's range is made in FP32 and holds no scale down", "[rules]") {
  // CLIP's logit_scale: its product with the features promotes to float32, and its gradient
  // (a sum over every logit) is finite at 2^13 times 65504 while b.weight underflows.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.zeros_fraction("b.weight", 0.6, 0.2).absmax_times("head.weight", 8192.0);
  f.step(65536, 1024, 50000, {"a.weight"});
  for (int i = 0; i < 10; ++i) f.step(1024, 1024, 50000);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE(find(r, "low-headroom") != nullptr);  // a's and b's, within range, still are
  for (const auto& finding : r.findings) CHECK_FALSE((finding.rule == "low-headroom" && finding.layer == "head.weight"));
}

namespace {

// kLayers-like run with a float32 Embedding `emb.weight` near the top of fp16's range
// (`emb_factor` times the others' 50000) while b.weight underflows; `tied`: the head
// shares its tensor (event "shared-parameter").
Report embedding_near_top(double emb_factor, bool tied) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"emb.weight", "a.weight", "b.weight"}, 0, 1, "float32",
               {{"emb.weight", "Embedding"}});
  if (tied) f.event("shared-parameter", "head.weight is the same tensor as layer 0; its statistics are recorded once");
  f.zeros_fraction("b.weight", 0.6, 0.2).absmax_times("emb.weight", emb_factor);
  f.step(65536, 1024, 50000, {"a.weight"});
  for (int i = 0; i < 10; ++i) f.step(1024, 1024, 50000);
  f.finish();
  return report_of(dir.file("run.db"));
}

// `layer`'s low-headroom finding in `r`, or null.
const Finding* headroom_of(const Report& r, const std::string& layer) {
  const auto f = std::find_if(r.findings.begin(), r.findings.end(),
                              [&](const Finding& g) { return g.rule == "low-headroom" && g.layer == layer; });
  return f == r.findings.end() ? nullptr : &*f;
}

bool headroom_for(const Report& r, const std::string& layer) { return headroom_of(r, layer) != nullptr; }

}  // namespace

TEST_CASE("a float32 embedding's gradient is an FP32 sum that holds no scale down", "[rules]") {
  // Autocast runs an embedding in FP32 (GPT-2's wpe): its gradient near 65504 is no fp16
  // tensor's, and pinning it, the fix low-headroom gives, would change nothing.
  const Report r = embedding_near_top(1.0, false);
  CHECK_FALSE(headroom_for(r, "emb.weight"));
  CHECK(headroom_for(r, "a.weight"));
}

TEST_CASE("a tied float32 embedding near the top keeps low-headroom: its head's part is fp16", "[rules]") {
  CHECK(headroom_for(embedding_near_top(1.0, true), "emb.weight"));
}

TEST_CASE("a tied float32 embedding finite beyond fp16's top is an FP32 sum, not its head's", "[rules]") {
  // GPT-2's wte, tied to lm_head: finite at 16 times 65504, which no fp16 tensor holds.
  CHECK_FALSE(headroom_for(embedding_near_top(16.0, true), "emb.weight"));
}

namespace {

// A norm's weight finite at `factor` times the others' 50000 while b.weight underflows;
// each step sums `micro_batches` losses.
Report norm_beyond_top(double factor, std::int64_t micro_batches) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"norm.weight", "a.weight", "b.weight"}, 0, 1, "float32",
               {{"norm.weight", "LayerNorm"}});
  f.micro_batches(micro_batches).zeros_fraction("b.weight", 0.6, 0.2).absmax_times("norm.weight", factor);
  f.step(65536, 1024, 50000, {"a.weight"});
  for (int i = 0; i < 10; ++i) f.step(1024, 1024, 50000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an untied gradient finite beyond fp16's top in a one-batch step is an FP32 sum", "[rules]") {
  // A LayerNorm's weight: autocast's FP32 layer_norm sums its gradient over every token, at
  // 1.8 times 65504 in a small LM, where no fp16 tensor could hold it.
  const Report r = norm_beyond_top(2.4, 1);
  CHECK_FALSE(headroom_for(r, "norm.weight"));
  CHECK(headroom_for(r, "a.weight"));
}

TEST_CASE("a gradient beyond fp16's top within what its micro-batches sum to keeps low-headroom", "[rules]") {
  // Four micro-batches' fp16 gradients, each within range, add up past 65504.
  CHECK(headroom_for(norm_beyond_top(2.4, 4), "norm.weight"));
}

TEST_CASE("a negative headroom says the gradient was above fp16's top, as only a sum can be", "[rules]") {
  // "least headroom -1.26 bits" alone read as a contradiction of "within 1 bit(s)".
  const Report r = norm_beyond_top(2.4, 4);
  const Finding* norm = headroom_of(r, "norm.weight");
  REQUIRE(norm != nullptr);
  CHECK_THAT(norm->evidence, Catch::Contains("bits: above 65504, as only a sum of gradients each within it can be (the "
                                             "step's micro-batches, or a tied parameter's uses))"));
  const Finding* a = headroom_of(r, "a.weight");
  REQUIRE(a != nullptr);
  CHECK_THAT(a->evidence, !Catch::Contains("as only a sum"));
}
