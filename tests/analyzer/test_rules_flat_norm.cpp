// overflow-origin: a module's true gradients too large for the floor where a normalisation
// after it normalised an input with next to no spread (DETR's first decoder self-attention
// over queries of zeros), and the pin of the block that holds every layer beyond the floor.
#include "rule_test.h"

namespace {

struct FlatNormRun {
  bool flat = true;           // blk.norm's output all zeros; else of RMS 1, its weight's
  double backbone = 1 << 20;  // values of backbone.weight, outside blk
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
  f.module_type("blk.norm", "LayerNorm");
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
