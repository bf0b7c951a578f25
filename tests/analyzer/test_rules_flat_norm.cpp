// overflow-origin: a module's true gradients too large for the floor where a normalisation
// after it normalised an input with next to no spread (DETR's first decoder self-attention
// over queries of zeros), and the pin of the block that holds every layer beyond the floor.
#include "rule_test.h"

namespace {

struct FlatNormRun {
  bool flat = true;           // blk.norm's output all zeros; else of RMS 1, its weight's
  std::int64_t backbone = 1 << 20;  // values of backbone.weight, outside blk
  std::string norm_type = "LayerNorm";
};

// blk.o_proj.bias overflows first 12 times from a scale of 65536, then the scale settles at 16
// where its gradients fit (2312 unscaled), blk.v_proj.bias's half of them; blk.norm, with a
// weight of RMS 1, finishes after blk, which holds o_proj.
Report flat_norm_run(const TempDir& dir, const FlatNormRun& run) {
  RunFixture f(dir.file("run.db"), {"backbone.weight", "blk.v_proj.bias", "blk.o_proj.bias", "blk.norm.weight"}, 0, 1,
               "float32", {{"blk.norm.weight", "LayerNorm"}},
               {{"backbone.weight", {run.backbone}}, {"blk.v_proj.bias", {64}}, {"blk.o_proj.bias", {64}},
                {"blk.norm.weight", {64}}});
  f.absmax_times("backbone.weight", 0.001).absmax_times("blk.v_proj.bias", 0.5).absmax_times("blk.norm.weight", 0.001);
  f.module_type("blk.norm", run.norm_type);
  double scale = 65536;
  for (int i = 0; i < 32; ++i) {
    f.weight_norm("blk.norm.weight", 8.0);
    f.activation("blk.o_proj", false, 0.0, 0.0, run.flat).activation("blk", false, 0.0, 0.0, run.flat);
    f.activation("blk.norm", false, run.flat ? 0.0 : 3.0, run.flat ? 0.0 : 64.0, run.flat);
    if (i < 12) {
      f.step(scale, scale / 2, 1000, {"blk.o_proj.bias"}, 12.0);
      scale /= 2;
    } else {
      f.step(scale, scale, 37000, {}, 12.0);
    }
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("gradients too large behind a norm of a constant input name that norm", "[rules][flat]") {
  TempDir dir;
  const Report r = flat_norm_run(dir, {});
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "blk.o_proj");
  CHECK_THAT(o.evidence, Catch::Contains("; blk.norm (LayerNorm), which takes blk.o_proj's output, normalised an input "
                                         "with next to no spread (its output was all zeros at step 31)"));
}

TEST_CASE("gradients too large behind a norm of a varied input do not name it", "[rules][flat]") {
  TempDir dir;
  const Report r = flat_norm_run(dir, {false});
  CHECK_THAT(required(r, "overflow-origin").evidence, !Catch::Contains("blk.norm"));
}

TEST_CASE("gradients too large behind MobileBERT's NoNorm, an affine map, do not name it", "[rules][flat]") {
  TempDir dir;
  const Report r = flat_norm_run(dir, {true, 1 << 20, "NoNorm"});
  CHECK_THAT(required(r, "overflow-origin").evidence, !Catch::Contains("blk.norm"));
}

TEST_CASE("gradients too large in two layers of one small block are told to pin that block", "[rules][flat]") {
  TempDir dir;
  const Report r = flat_norm_run(dir, {});
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() == 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run blk in FP32, which holds blk.o_proj and every other "
                                                         "layer whose gradients passed 65504 / 128"));
  CHECK_THAT(o.suggestions[0].python, Catch::StartsWith("ampdiag.pin_fp32(model.blk)"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Or train in bfloat16"));
}

TEST_CASE("gradients too large in two layers of a block holding most of the model are not told to pin it",
          "[rules][flat]") {
  TempDir dir;
  const Report r = flat_norm_run(dir, {true, 64});
  for (const auto& s : required(r, "overflow-origin").suggestions) CHECK_THAT(s.summary, !Catch::Contains("Run blk"));
}

namespace {

// blk.q.weight's gradients mostly fp16-subnormal at a scale of 256, while blk.o_proj.bias's
// come within 1.6 of 65504 there: no scale lifts them; `norm` (blk.norm, inside blk, or a
// sibling of blk) after blk all zeros when `flat`.
Report held_down_run(const TempDir& dir, bool flat, const std::string& norm = "blk.norm") {
  RunFixture f(dir.file("run.db"), {"backbone.weight", "blk.q.weight", "blk.o_proj.bias", norm + ".weight"}, 0, 1,
               "float32", {{norm + ".weight", "LayerNorm"}},
               {{"backbone.weight", {1 << 20}}, {"blk.q.weight", {64, 64}}, {"blk.o_proj.bias", {64}},
                {norm + ".weight", {64}}});
  f.absmax_times("backbone.weight", 0.01).absmax_times("blk.q.weight", 0.01).absmax_times(norm + ".weight", 0.01);
  f.zeros_fraction("blk.q.weight", 0.3, 0.6);
  f.module_type(norm, "LayerNorm");
  for (int i = 0; i < 20; ++i) {
    f.weight_norm(norm + ".weight", 8.0);
    f.activation("blk.o_proj", false, 0.0, 0.0, true).activation("blk", false, 0.0, 0.0, true);
    f.activation(norm, false, flat ? 0.0 : 3.0, flat ? 0.0 : 64.0, flat);
    f.step(256, 256, 40000);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an underflow held down by gradients behind a norm of a constant input is told to pin their block",
          "[rules][flat]") {
  TempDir dir;
  const Report r = held_down_run(dir, true);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.title, Catch::EndsWith("no loss scale lifts it without blk.o_proj.bias overflowing"));
  REQUIRE(u.suggestions.size() == 2);
  CHECK_THAT(u.suggestions[0].summary, Catch::StartsWith("Run blk.o_proj in FP32: blk.norm, which takes its output, "
                                                         "normalised an input with next to no spread"));
  CHECK_THAT(u.suggestions[1].summary, Catch::StartsWith("Or train in bfloat16"));
}

TEST_CASE("an underflow held down by gradients behind a norm of a varied input is told bf16 only", "[rules][flat]") {
  TempDir dir;
  const Report r = held_down_run(dir, false);
  const Finding& u = required(r, "underflow");
  REQUIRE(u.suggestions.size() == 1);
  CHECK_THAT(u.suggestions[0].summary, Catch::StartsWith("Train in bfloat16"));
}

TEST_CASE("an underflow held down behind a norm after a block is told to pin the whole block", "[rules][flat]") {
  // DETR's self_attn_layer_norm takes the output of self_attn, whose output projection's and
  // value projection's biases both take its gradient.
  TempDir dir;
  const Report r = held_down_run(dir, true, "norm_after_blk");
  REQUIRE(!required(r, "underflow").suggestions.empty());
  CHECK_THAT(required(r, "underflow").suggestions[0].summary,
             Catch::StartsWith("Run blk in FP32: norm_after_blk, which takes its output, normalised an input"));
}

namespace {

// BLIP-2's Q-Former in miniature: out.dense's gradient NaN/Inf first in each of 12 steps, the
// scale halving from 65536 with no finite step; out.norm, inside out, made all zeros; a
// learned input `zero_input` ([1, 8, 64]) at exactly zero, beside a zero bias.
Report zero_queries_run(const TempDir& dir, const std::string& zero_input) {
  RunFixture f(dir.file("run.db"), {zero_input, "out.dense.weight", "out.dense.bias", "out.norm.weight"}, 0, 1,
               "float32", {{"out.norm.weight", "LayerNorm"}},
               {{zero_input, {1, 8, 64}}, {"out.dense.bias", {64}}, {"out.norm.weight", {64}}});
  f.module_type("out.norm", "LayerNorm");
  double scale = 65536;
  for (int i = 0; i < 12; ++i) {
    f.weight_norm(zero_input, 0.0).weight_norm("out.dense.bias", 0.0).weight_norm("out.norm.weight", 8.0);
    f.activation("out.dense", false, 0.0, 0.0, true).activation("out.norm", false, 0.0, 0.0, true);
    f.activation("out", false, 0.0, 0.0, true);
    f.step(scale, scale / 2, 1000, {"out.dense.weight"}, 2.3);
    scale /= 2;
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("gradients with no finite step behind a norm that made all zeros name that norm", "[rules][flat]") {
  TempDir dir;
  const Report r = zero_queries_run(dir, "query_tokens");
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "out.dense");
  CHECK_THAT(o.evidence, Catch::Contains("; out.norm (LayerNorm), which takes out.dense's output, normalised an input "
                                         "with next to no spread (its output was all zeros at step 11)"));
}

TEST_CASE("a learned input that started at zeros before a flat norm leads with its initialisation", "[rules][flat]") {
  TempDir dir;
  const Report r = zero_queries_run(dir, "query_tokens");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise query_tokens away from zero"));
  CHECK(o.suggestions[0].python == "torch.nn.init.normal_(model.get_parameter(\"query_tokens\"), std=0.02)  # was all zeros");
}

TEST_CASE("a weight that started at zeros before a flat norm is no learned input to initialise", "[rules][flat]") {
  TempDir dir;  // LoRA's lora_B starts at zeros by design
  const Report r = zero_queries_run(dir, "adapter.lora_B.weight");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, !Catch::StartsWith("Initialise"));
}
