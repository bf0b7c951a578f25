// The analyzer's rules on hand-built run.db fixtures, one situation per test.
#include "rule_test.h"

#include <algorithm>
#include <cmath>

#include "ampdiag/analyzer/layer_table.h"

TEST_CASE("a run without skipped steps is healthy", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 20; ++i) f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  CHECK(r.skipped.empty());
}

TEST_CASE("steps recorded without their device statistics are counted in the report, not judged", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 20; ++i) f.step(65536, 65536);
  f.meta("dropped_steps", "3").meta("dropped_records", "0");
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  REQUIRE(r.runs.size() == 1);
  CHECK(r.runs[0].dropped_steps == 3);
  CHECK(render_text(r, Gate("error")).find("3 steps without their device statistics (they never arrived)") !=
        std::string::npos);
  CHECK(render_json(r, Gate("error")).find("\"dropped_steps\": 3") != std::string::npos);
}

TEST_CASE("a skipped step whose loss was not recorded is still a backward overflow", "[rules]") {
  // scale() given a non-scalar output: the loss is unknown, which is not a NaN/Inf one, so
  // the forward did not fail and the first gradient in backward order is named.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) f.no_loss().step(scale, scale / 2, 1000, {"b.weight", "a.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->layer == "b.weight");
  CHECK(find(r, "forward-nonfinite") == nullptr);
}

TEST_CASE("every step skipped: the first layer in backward order is named, the scale collapses", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"b.weight", "a.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE_FALSE(r.findings.empty());
  CHECK(r.findings.front().rule == "overflow-origin");
  CHECK(r.findings.front().module == "b");
  CHECK(r.findings.front().layer == "b.weight");
  CHECK(find(r, "scale-collapse") != nullptr);
  REQUIRE(find(r, "skip-rate") != nullptr);
  CHECK(find(r, "skip-rate")->severity == Severity::kError);
  REQUIRE(r.skipped.size() == 12);
  CHECK(r.skipped[0].nonfinite_layers == std::vector<std::string>{"b.weight", "a.weight"});
}

namespace {

// The overflow-origin finding of a run whose every step overflows first at `layer`.
Finding overflow_first_at(const std::string& layer) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {layer, "enc.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {layer});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module.empty());
  CHECK(o->layer == layer);
  REQUIRE(o->suggestions.size() == 2);
  return *o;
}

}  // namespace

TEST_CASE("a parameter of the model itself is placed in the model's own forward(), with no pin of an empty path", "[rules]") {
  // CLIP's text_projection: a bare nn.Parameter of the root module, used in its forward().
  const Finding o = overflow_first_at("text_projection");
  CHECK_THAT(o.title, Catch::StartsWith("The model's own forward(), where it uses text_projection, overflows first"));
  CHECK_THAT(o.suggestions.front().python, Catch::Contains("around the code that uses self.text_projection"));
  CHECK_THAT(o.suggestions.front().python, !Catch::Contains("pin_fp32"));
}

TEST_CASE("a parameter outside the attached model is named as such, and the fix attaches its model", "[rules]") {
  // A GAN whose discriminator's optimizer goes through the scaler, with only the generator attached.
  const Finding o = overflow_first_at("optimizer.param0");
  CHECK_THAT(o.title, Catch::StartsWith("optimizer.param0, a parameter outside the attached model, overflows first"));
  CHECK_THAT(o.suggestions.front().python, Catch::Contains("torch.nn.ModuleDict"));
}

TEST_CASE("a module at \"model\" is titled with its type, not as the whole model", "[rules]") {
  // A Hugging Face LlamaForCausalLM: its LlamaModel sits at "model", beside lm_head.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"model.a.weight", "model.b.weight", "lm_head.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("model", false).finite_first({"lm_head.weight", "model.a.weight"}).step(scale, scale / 2, 1000,
                                                                                          {"model.b.weight"});
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "model");
  CHECK_THAT(o.title, Catch::StartsWith("model (Module) overflows first in backward"));
}

namespace {

// enc's gradients go NaN/Inf first in 24 skips halving the scale from 65536, head's the last
// finite before them, with `between`, a module without parameters, run between the two.
Report nan_through(const TempDir& dir, const std::string& between) {
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2)
    f.activation("enc", false).activation(between, false).activation("head", false).finite_first({"head.weight"}).step(
        scale, scale / 2, 1000, {"enc.weight"});
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a layer going NaN first at scales below 1 gets its backward looked at before any pin", "[rules]") {
  // A pairwise distance module between enc and head: sqrt(0)'s gradient is NaN at any scale.
  TempDir dir;
  const auto r = nan_through(dir, "dist");
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module == "enc");
  CHECK_THAT(o->title, Catch::Contains("at every loss scale, down to 0.0078125"));
  CHECK_THAT(o->evidence, Catch::Contains("the backward also ran through dist, which holds no parameters"));
  REQUIRE(o->suggestions.size() == 4);
  CHECK_THAT(o->suggestions[0].summary, Catch::StartsWith("Look first at the backward of dist, enc"));
  CHECK_THAT(o->suggestions[2].summary, Catch::StartsWith("If its true gradients are the ones beyond fp16: Run enc in FP32"));
}

TEST_CASE("the look at a backward that makes NaN at every scale names the torch.where mask that hides it",
          "[rules]") {
  // A "safe" square root, where(x > 0, x.sqrt(), 0): the forward is finite, and the masked
  // values' gradient is 0 times NaN. sqrt(x + 1e-12) does not help a negative x; a clamp does.
  TempDir dir;
  const auto r = nan_through(dir, "act");
  const Suggestion& look = required(r, "overflow-origin").suggestions.front();
  CHECK_THAT(look.summary, Catch::Contains("Behind a torch.where that masks such values (where(x > 0, x.sqrt(), 0)) it "
                                           "still runs on them, and their gradient comes back as 0 times NaN: clamp the "
                                           "argument before the operation, then select."));
  CHECK_THAT(look.python, Catch::Contains("torch.where(x > 0, x.clamp_min(1e-12).sqrt(), 0.0)"));
}

TEST_CASE("a module without parameters that the NaN gradient passed gets its own pin, untried", "[rules]") {
  // A custom activation whose backward takes exp() of its fp16 input: pinned, it trains. No
  // replay of its backward is made (it holds no parameters), so sqrt(0)'s kind is not ruled out.
  TempDir dir;
  const auto r = nan_through(dir, "act");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("If instead a value inside act's backward passes fp16's range"));
  CHECK_THAT(o.suggestions[1].python, Catch::StartsWith("ampdiag.pin_fp32(model.act)"));
  CHECK(o.suggestions[1].untried);
}

namespace {

// enc's gradients go NaN first at every scale, head's the last finite before them; the
// forward calls enc, head from step 0 and `from_step_2` between them from step 2 on.
Report between_run(const std::vector<std::string>& first_steps, const std::vector<std::string>& from_step_2) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2) {
    f.activation("enc", false);
    for (const auto& m : i < 2 ? first_steps : from_step_2) f.activation(m, false);
    f.activation("head", false).finite_first({"head.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a module without parameters first called after both layers is named where the gradient passed", "[rules]") {
  // dist's module id comes after head's: by ids it would not lie between enc and head.
  const Report r = between_run({}, {"dist"});
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("the backward also ran through dist, which holds no parameters"));
}

TEST_CASE("a module without parameters no longer called between the layers is not named", "[rules]") {
  // pool's id lies between enc's and head's, but the forwards since step 2 skip it.
  const Report r = between_run({"pool"}, {});
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, !Catch::Contains("pool"));
}

namespace {

// head's gradients overflow at every step from a scale of 65536 down, `backoffs` times (the
// loss at `loss`), then the scale stays where they fit, at a scaled abs-max of 37000; enc's
// are `enc_share` of head's.
Report settled_where_head_fits(const TempDir& dir, int backoffs, int settled, double loss, double settled_loss = -1.0,
                               double enc_share = 1.0) {
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  f.absmax_times("enc.weight", enc_share);
  double scale = 65536;
  for (int i = 0; i < backoffs; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"}, loss);
  for (int i = 0; i < settled; ++i) f.step(scale, scale, 37000, {}, settled_loss >= 0.0 ? settled_loss : loss);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a layer whose finite steps show gradients beyond fp16's range unscaled is told to shrink the loss",
          "[rules]") {
  // Unnormalised regression targets (a loss around 9e10): the scaler settles at 1/16, where
  // the last layer's gradients fit, and their unscaled size is ~6e5. No sqrt is to blame.
  // enc's are a thousandth of them, within range: pinning head alone keeps them all in range.
  TempDir dir;
  const auto r = settled_where_head_fits(dir, 20, 10, 9e10, -1.0, 0.001);
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module == "head");
  CHECK_THAT(o->title, Catch::Contains("head's gradients exceed fp16's range even unscaled (up to 592000)"));
  REQUIRE(o->suggestions.size() == 3);
  CHECK_THAT(o->suggestions[0].summary, Catch::StartsWith("Shrink the loss where it is made (it is around 9e+10"));
  CHECK_THAT(o->suggestions[1].summary, Catch::StartsWith("Run head in FP32"));
}

TEST_CASE("gradients beyond fp16's range in every layer are not offered the first one's pin", "[rules]") {
  // The same run with enc's gradients as large as head's: pinned, head would keep its own in
  // FP32 and enc's would still overflow.
  TempDir dir;
  const auto r = settled_where_head_fits(dir, 20, 10, 9e10);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::EndsWith("; other layers' unscaled gradients were beyond 65504 too (enc.weight up to "
                                         "592000), so pinning head alone would leave theirs overflowing"));
  REQUIRE(o.suggestions.size() == 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Shrink the loss where it is made"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Or train in bfloat16"));
}

TEST_CASE("gradients too large for the floor in another layer too leave the first one unpinned", "[rules]") {
  // A UNet whose middle convolution starts 3000 times too large: the loss is around 3500 and
  // the scale settles below the floor. out, the last convolution, overflows first; pinned, the
  // overflow moved to the skip convolution before it, whose gradients were as large.
  TempDir dir;
  const auto r = settled_where_head_fits(dir, 12, 20, 3500, -1.0, 0.5);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("; other layers' unscaled gradients were beyond 65504 / 128 too (enc.weight up "
                                         "to 1156.25), so pinning head alone would leave the scale below the floor"));
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::Contains("Run head in FP32"));
}

TEST_CASE("a normalisation layer's, a float32 embedding's or a pinned module's large gradients do not keep the pin "
          "from the layer that overflows",
          "[rules]") {
  // Autocast runs LayerNorm and embeddings in FP32, and a pinned module runs so whole: their
  // gradients pass 65504 without an fp16 backward (a Qwen2 LM's embed_tokens, a sum over the
  // tokens).
  const std::string type = GENERATE(std::string("LayerNorm"), std::string("Embedding"), std::string("pinned"));
  CAPTURE(type);
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"norm.weight", "head.weight"}, 0, 1, "float32",
               {{"norm.weight", type == "pinned" ? std::string("Linear") : type}});
  if (type == "pinned") f.event("pinned-fp32", "norm");
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"}, 3500);
  for (int i = 0; i < 20; ++i) f.step(scale, scale, 37000, {}, 3500);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, !Catch::Contains("other layers' unscaled gradients"));
  CHECK(std::any_of(o.suggestions.begin(), o.suggestions.end(),
                    [](const Suggestion& s) { return s.summary.rfind("Run head in FP32", 0) == 0; }));
}

TEST_CASE("a layer whose gradients fit only below the floor scale is told to shrink the loss", "[rules]") {
  // An autoencoder on raw 0..255 pixels: a loss around 9000, the scaler settles at 16, where
  // the last layer's gradients (~2300 unscaled) fit. Normalised inputs train at 65536.
  TempDir dir;
  const auto r = settled_where_head_fits(dir, 12, 20, 9000);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.title == "head's gradients are too large for a loss scale above the floor of 128 (up to 2312.5 unscaled)");
  CHECK_THAT(o.evidence, Catch::Contains("above 65504 / 128: the scale has to stay below the floor to fit them"));
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Shrink the loss where it is made (it is around 9000"));
}

TEST_CASE("a layer whose gradients fit only below the floor under an ordinary loss is not told to shrink it",
          "[rules]") {
  // MobileOne's 1x1 depthwise scale branch before a BatchNorm: gradients of 790 under a
  // cross-entropy around 2.9, which sends gradients of a few units: dividing it by a constant
  // would only do what a lower scale does.
  TempDir dir;
  const auto r = settled_where_head_fits(dir, 12, 20, 2.9);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.title == "head's gradients are too large for a loss scale above the floor of 128 (up to 2312.5 unscaled)");
  CHECK_THAT(o.evidence, Catch::Contains("; the loss is around 2.9, whose gradients are of the order of it: the "
                                         "model's own operations make them this large"));
  REQUIRE(!o.suggestions.empty());
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("Shrink the loss"));
}

TEST_CASE("a loss large only in the steps that overflowed points at what those steps do differently", "[rules]") {
  // A loss around 9000 while head's gradients overflowed, 0.5 in the other steps (the run's
  // median): not the targets, which are the same every step, but those steps' batches, or a
  // branch or an expert only they take.
  TempDir dir;
  const auto r = settled_where_head_fits(dir, 12, 20, 9000, 0.5);
  const Suggestion& shrink = required(r, "overflow-origin").suggestions.front();
  CHECK_THAT(shrink.summary,
             Catch::StartsWith("Shrink the loss where it is made (it is around 9000 in the steps where its gradients "
                               "overflowed, against 0.5 in the others") &&
                 Catch::Contains("what those steps do differently makes it so large") &&
                 !Catch::Contains("normalise the regression targets"));
  CHECK(shrink.python.empty());
}

TEST_CASE("a scale stuck at its floor is a collapse", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(256, 128, 1000, {"a.weight"}).step(128, 64, 1000, {"a.weight"});
  for (int i = 0; i < 10; ++i) f.step(64, 64);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "scale-collapse");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK_THAT(c->evidence, Catch::Contains("stayed at its lowest"));
}

TEST_CASE("a scale below 1 is called out as such", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(2, 1, 1000, {"a.weight"}).step(1, 0.5, 1000, {"a.weight"}).step(0.5, 0.25, 1000, {"a.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "scale-collapse");
  REQUIRE(c != nullptr);
  CHECK_THAT(c->title, Catch::Contains("below 1"));
}

TEST_CASE("a single step loads and analyzes", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.runs.front().steps == 1);
  CHECK(r.healthy());
}

TEST_CASE("a NaN loss with probes names the first non-finite module in forward order", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 5; ++i, scale /= 2) {
    f.activation("enc.0", false).activation("enc.1", true).activation("head", true);
    f.step(scale, scale / 2, 1000, {"head.weight", "b.weight"}, kNaN);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE_FALSE(r.findings.empty());
  CHECK(r.findings.front().rule == "forward-nonfinite");
  CHECK(r.findings.front().module == "enc.1");
  // A forward failure is not blamed on the last layer of backward.
  CHECK(find(r, "overflow-origin") == nullptr);
  CHECK(r.skipped.front().forward_module == "enc.1");
}

TEST_CASE("a layer that appears mid-run is summarised from where it starts", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 10; ++i) f.step(65536, 65536, 1000, {}, 0.5, {"a.weight", "a.bias", "b.weight"});
  for (int i = 0; i < 5; ++i) f.step(65536, 65536);
  f.finish();
  const auto run = load_run(dir.file("run.db"));
  REQUIRE(run.layers[3].samples.size() == 5);
  CHECK(run.layers[3].samples.front().step == 10);
  CHECK(analyze({run}).healthy());
}

TEST_CASE("a bf16 run without a scaler has no scale to collapse and no fp16 underflow", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("amp_dtype", "bfloat16").meta("scaler_enabled", "0");
  f.zeros_fraction("b.weight", 0.6, 0.2);
  for (int i = 0; i < 10; ++i) f.step(1, 1);
  f.finish();
  CHECK(report_of(dir.file("run.db")).healthy());
}

TEST_CASE("a float32 run (AMP off) judges its values by fp32's range, not fp16's", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("amp_dtype", "float32").meta("scaler_enabled", "0");
  for (int i = 0; i < 10; ++i) f.step(1, 1, 1e6);  // beyond fp16's 65504
  f.finish();
  const auto run = load_run(dir.file("run.db"));
  const auto r = analyze({run});
  CHECK(r.healthy());
  const auto rows = rank_layers(run, r);
  REQUIRE(!rows.empty());
  CHECK(rows.front().least_headroom == Approx(std::log2(3.4028234663852886e38 / 1e6)));
}

TEST_CASE("a scale below 1 from the first step that never backed off is a warning, not a collapse", "[rules]") {
  // A scaler restored from a checkpoint at 1/16 (or made with a low init_scale): nothing in
  // the recording overflowed or backed off, so nothing collapsed here.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 10; ++i) f.step(0.0625, 0.0625);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "scale-collapse");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kWarning);
  CHECK_THAT(c->title, Catch::Contains("is 0.0625, below 1, from the first step"));
  CHECK_THAT(c->title, !Catch::Contains("fell"));
  CHECK_THAT(c->evidence, Catch::Contains("load_state_dict"));
  CHECK_FALSE(Gate("error").fails(r));
}

TEST_CASE("a scale that starts below the floor and grows past it without backing off is no finding", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (double scale = 16; scale < 512; scale *= 2) f.step(scale, scale).step(scale, scale * 2);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "scale-collapse") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("a scale below the floor that never backed off asks for a higher init_scale", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 10; ++i) f.step(16, 16);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "scale-collapse");
  REQUIRE(c != nullptr);
  CHECK_THAT(c->suggestions.front().python, Catch::Contains("init_scale=2.0**16"));
  CHECK_THAT(c->evidence, Catch::Contains("no step overflowed"));
}

TEST_CASE("a module whose different gradients were first in different steps gives each its count", "[rules]") {
  // It used to say its most frequent layer was first in every one of the module's steps.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 32768, 1000, {"a.bias"});
  for (int i = 0; i < 6; ++i) f.step(32768, 32768);
  f.step(32768, 16384, 1000, {"a.weight", "a.bias"});
  for (int i = 0; i < 6; ++i) f.step(16384, 16384);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module == "a");
  CHECK_THAT(o->evidence, Catch::Contains("a gradient of a was the first (in backward order) to hold NaN/Inf in 2 of 2 "
                                          "skipped steps (a.weight in 1, a.bias in 1; steps 0, 7)"));
}

TEST_CASE("a rank that disagrees with the others is named", "[rules][ranks]") {
  TempDir dir;
  {
    RunFixture r0(dir.file("run.rank0.db"), kLayers, 0, 2);
    RunFixture r1(dir.file("run.rank1.db"), kLayers, 1, 2);
    for (int i = 0; i < 10; ++i) {
      r0.step(65536, 65536);
      if (i == 3 || i == 4)
        r1.step(65536, 65536, 1000, {"b.weight"});
      else
        r1.step(65536, 65536);
    }
    r0.finish();
    r1.finish();
  }
  const auto r = analyze({load_run(dir.file("run.rank0.db")), load_run(dir.file("run.rank1.db"))});
  const Finding* d = find(r, "rank-disagreement");
  REQUIRE(d != nullptr);
  CHECK(d->ranks == std::vector<std::int64_t>{1});
  CHECK(d->layer == "b.weight");
  CHECK(d->severity == Severity::kError);
}

TEST_CASE("the gate fails on the rules it names and only those", "[rules][gate]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.zeros_fraction("b.weight", 0.6, 0.2);
  for (int i = 0; i < 5; ++i) f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK_FALSE(Gate("error").fails(r));  // underflow is a warning
  CHECK(Gate("all").fails(r));
  CHECK(Gate("underflow").fails(r));
  CHECK_FALSE(Gate("skip-rate,scale-collapse").fails(r));
  CHECK_FALSE(Gate("none").fails(r));
  CHECK_THROWS_WITH(Gate("no-such-rule"), Catch::Contains("unknown rule"));
}

namespace {

// A forward overflow first at `first` in a Python agent's run whose modules are `ran` (every
// module that ran has a row: the agent watches them all), not replayed.
Report python_forward_overflow(const TempDir& dir, const std::vector<std::string>& ran, const std::string& first) {
  RunFixture f(dir.file("run.db"), {"layers.2.weight", "head.weight"});
  f.meta("source", "ampdiag Python agent");
  for (int i = 0; i < 3; ++i) {
    for (const auto& m : ran) f.activation(m, m == first);
    f.step(65536, 32768, 1000, {}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a pin's plain-torch lines go in the model's forward() where the module's container never ran",
          "[rules][suggestions]") {
  // A block in the model's ModuleList: the list has no forward, the model's calls the block.
  TempDir dir;
  const Report r = python_forward_overflow(dir, {"layers.1", "layers.2", "head"}, "layers.2");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("where the model's forward() calls it"));
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("out = model.layers[2]("));
}

TEST_CASE("a pin's plain-torch lines go in the nearest module above it that ran, called by its path below it",
          "[rules][suggestions]") {
  // blocks.3's forward() calls self.attn.qkv directly: attn itself never ran.
  TempDir dir;
  const Report r = python_forward_overflow(dir, {"blocks.3.attn.qkv", "blocks.3", "head"}, "blocks.3.attn.qkv");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("where blocks.3's forward() calls it"));
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("out = self.attn.qkv("));
}

TEST_CASE("suggestions name the exact module path in Python and C++", "[rules][suggestions]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"blocks.3.attn.qkv.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 10; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"blocks.3.attn.qkv.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const auto& s = r.findings.front().suggestions.front();
  CHECK_THAT(s.python, Catch::Contains("torch.autocast(device_type=\"cpu\", enabled=False)"));
  CHECK_THAT(s.python, Catch::Contains("ampdiag.pin_fp32(model.blocks[3].attn.qkv)"));
  CHECK_THAT(s.python, Catch::Contains("where blocks.3.attn's forward() calls it"));
  CHECK_THAT(s.python, Catch::Contains("out = self.qkv(x.float())"));
  CHECK_THAT(s.cpp, Catch::Contains("ampdiag::Fp32Pins pins({\"blocks.3.attn.qkv\"})"));
}

TEST_CASE("the bf16 suggestion's C++ snippet sets autocast on the run's own device", "[rules][suggestions]") {
  for (const std::string device : {"cpu", "cuda:0"}) {
    TempDir dir;
    RunFixture f(dir.file("run.db"), {"blocks.3.attn.qkv.weight", "head.weight"});
    f.meta("device", device);
    double scale = 65536;
    for (int i = 0; i < 10; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"blocks.3.attn.qkv.weight"});
    f.finish();
    const auto r = report_of(dir.file("run.db"));
    const auto& suggestions = r.findings.front().suggestions;
    const auto bf16 = std::find_if(suggestions.begin(), suggestions.end(),
                                   [](const Suggestion& s) { return s.summary.find("bfloat16") != std::string::npos; });
    REQUIRE(bf16 != suggestions.end());
    const std::string type = device == "cpu" ? "at::kCPU" : "at::kCUDA";
    INFO(device);
    CHECK_THAT(bf16->cpp, Catch::Contains("set_autocast_dtype(" + type + ", at::kBFloat16)"));
    CHECK_THAT(bf16->cpp, Catch::Contains("set_autocast_enabled(" + type + ", true)"));
  }
}

TEST_CASE("the verdict line counts only the findings that fail the gate, in singular or plural", "[render]") {
  Finding error, warning;
  error.rule = "scale-collapse", error.severity = Severity::kError;
  warning.rule = "underflow", warning.severity = Severity::kWarning;
  Report r;
  r.findings = {error, warning};
  CHECK(findings_summary(r, Gate("error")) == "2 findings, 1 fails the gate (--fail-on error)");
  r.findings = {warning};
  CHECK(findings_summary(r, Gate("error")) == "1 finding, none fails the gate (--fail-on error)");
  CHECK(render_text(r, Gate("error")).rfind("WARNINGS: 1 finding, none fails the gate", 0) == 0);
}
