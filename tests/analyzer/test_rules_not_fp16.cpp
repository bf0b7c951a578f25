// NaN/Inf that is not fp16's doing in a module: made in the loss, already in the batch,
// written into the parameters by an earlier update, or absorbed by the model. The rules
// name the loss, the data or the update, and never blame the module that showed it first
// (tests/scenarios/test_loss_diagnosis.py runs the same cases as real torch loops).
#include "rule_test.h"

namespace {

// The forward-nonfinite finding of a run whose loss went NaN with no module output probed,
// after an agent event of `event_kind` (none if empty).
Finding unprobed_nan_loss(const std::string& event_kind) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  if (!event_kind.empty()) f.event(event_kind, "detail");
  f.step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module.empty());
  return *fw;
}

// The forward-nonfinite finding of `steps` steps in which `module`'s output goes NaN/Inf in
// every `every`-th, its FP32 replay `outcome`, each such step with an agent event of
// `event_kind` (none if empty).
Finding nonfinite_output(int every, const std::string& event_kind, const std::string& module = "proj",
                         const std::string& outcome = "finite", int steps = 6) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.replay(module, outcome);
  for (int i = 0; i < steps; ++i) {
    const bool nonfinite = i % every == every - 1;
    if (nonfinite && !event_kind.empty()) f.event(event_kind, "1 forward whose output went NaN/Inf (first at " + module + ")");
    f.activation(module, nonfinite).step(1024, 1024);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == module);
  return *fw;
}

}  // namespace

TEST_CASE("a NaN loss without probes says that no module was probed", "[rules]") {
  const Finding fw = unprobed_nan_loss("");
  CHECK_THAT(fw.title, Catch::Contains("no module output was probed"));
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("activations=True"));
}

TEST_CASE("a NaN loss unprobed because torch.compile came after attach says to attach after it", "[rules]") {
  // The hooks were registered (activations on), but the compiled graph traced them as no-ops:
  // "record activations" would be wrong advice.
  const Finding fw = unprobed_nan_loss("compiled-after-attach");
  CHECK_THAT(fw.evidence, Catch::Contains("compiled with torch.compile after attach()"));
  REQUIRE(fw.suggestions.size() == 1);
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("model = torch.compile(model)\nhandle = ampdiag.attach"));
}

TEST_CASE("an fp16 overflow in forward that the model absorbs is a warning, not the error", "[rules]") {
  // A clamp after the module: its Inf never reaches the loss or the gradients.
  const Finding fw = nonfinite_output(2, "");
  CHECK(fw.severity == Severity::kWarning);
  CHECK_THAT(fw.evidence, Catch::Contains("the model absorbed it"));
  CHECK_THAT(fw.suggestions.front().python, Catch::Contains("pin_fp32"));  // still a real overflow
}

namespace {

// The forward-nonfinite finding of 8 steps in which proj's output overflows every time and
// the model absorbs it: step 0 skips at 65536 (the scale's calibration, the loss finite),
// and step `late_skip` too if it is not -1, after the scale has settled.
Finding absorbed_with_skips(int late_skip) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.replay("proj", "finite");
  f.activation("proj", true).step(65536, 32768, 1000, {"head.weight"});
  for (int i = 1; i < 8; ++i) {
    f.activation("proj", true);
    i == late_skip ? f.step(32768, 16384, 1000, {"head.weight"}) : f.step(32768, 32768);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  return *fw;
}

}  // namespace

TEST_CASE("an absorbed fp16 overflow whose only skip is the scale's calibration is a warning", "[rules]") {
  const Finding fw = absorbed_with_skips(-1);
  CHECK(fw.severity == Severity::kWarning);
  CHECK_THAT(fw.evidence, Catch::Contains("the only ones skipped (1) were the loss scale's calibration"));
}

TEST_CASE("an absorbed fp16 overflow with a skip after the scale settled stays the error", "[rules]") {
  const Finding fw = absorbed_with_skips(7);
  CHECK(fw.severity == Severity::kError);
  CHECK_THAT(fw.evidence, !Catch::Contains("absorbed"));
}

TEST_CASE("an fp16 overflow in forward whose batch the loop dropped is the error, not absorbed", "[rules]") {
  // `if not torch.isfinite(loss): continue`: no step skipped, no NaN gradient or loss
  // recorded, yet the batch is lost to the overflow (event forward-dropped).
  const Finding fw = nonfinite_output(2, "forward-dropped");
  CHECK(fw.severity == Severity::kError);
  CHECK_THAT(fw.evidence, Catch::Contains("the loop dropped the batch in 3 steps before backward"));
  CHECK_THAT(fw.evidence, !Catch::Contains("absorbed"));
  CHECK_THAT(fw.evidence, !Catch::Contains("the loss was NaN/Inf in 0 steps"));
}

TEST_CASE("an fp16 overflow only in evaluations with gradients on is a warning that says so", "[rules]") {
  // model.eval() without torch.no_grad(): the validation loss goes NaN, training does not.
  const Finding fw = nonfinite_output(3, "evaluation-nonfinite");
  CHECK(fw.severity == Severity::kWarning);
  CHECK_THAT(fw.evidence, Catch::Contains("in 2 steps it went NaN/Inf in an evaluation"));
  CHECK_THAT(fw.evidence, !Catch::Contains("absorbed"));
}

TEST_CASE("a -inf mask's NaN whose batch the loop dropped is its code, not by design", "[rules]") {
  // The padding mask's empty row: NaN in FP32 too; the loop drops the NaN loss's batch, so
  // the recorded losses stay finite, but the batch was lost.
  const Finding fw = nonfinite_output(2, "forward-dropped", "attn", "intrinsic", 2);
  CHECK(fw.severity == Severity::kError);
  CHECK_THAT(fw.title, Catch::Contains("even in FP32: its code"));
  CHECK_THAT(fw.evidence, Catch::Contains("the loop dropped the batch in 1 step"));
}

TEST_CASE("NaN/Inf after an update that applied NaN/Inf gradients is that update's, not a module's", "[rules]") {
  // bf16 without a scaler: step 1's NaN batch gets applied; from then on the parameters are
  // NaN, and enc's output is NaN "from finite inputs" (its FP32 replay says intrinsic).
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("amp_dtype", "bfloat16").meta("scaler_enabled", "0").replay("enc", "intrinsic");
  f.activation("enc", false).step(1, 1);
  f.event("input-nan", "argument 0 (float32 [8, 16]): 1 NaN of 128 values").activation("enc", true);
  f.taken().step(1, 1, 1000, {"head.weight", "a.weight"}, kNaN);
  for (int i = 0; i < 4; ++i) f.activation("enc", true).taken().step(1, 1, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kError);
  CHECK(u->steps == std::vector<std::int64_t>{1});
  CHECK_THAT(u->evidence, Catch::Contains("4 of the 4 steps after it went NaN/Inf"));
  CHECK_THAT(u->evidence, Catch::Contains("the model's input held NaN/Inf"));
  const Finding* in = find(r, "input-nan");
  REQUIRE(in != nullptr);
  CHECK(in->steps == std::vector<std::int64_t>{1});
  CHECK(find(r, "forward-nonfinite") == nullptr);  // enc's NaN weights are no code of its own
}

TEST_CASE("a NaN loss whose gradients stayed finite is a warning: no update was lost", "[rules]") {
  // cross_entropy over a batch whose every label is ignore_index: 0/0, with zero gradients.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).step(65536, 65536);
  f.activation("enc", false).taken().step(65536, 65536, 1000, {}, kNaN);
  f.activation("enc", false).step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kWarning);
  CHECK_THAT(fw->evidence, Catch::Contains("no update was lost"));
}

TEST_CASE("a NaN in the model's input is the data's, not the module that showed it first", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).step(1024, 1024);
  f.event("input-nan", "argument 0 (float32 [32, 16]): 1 NaN of 512 values").activation("enc", true);
  f.step(1024, 512, 1000, {"head.weight"}, kNaN);
  f.activation("enc", false).step(512, 512);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* in = find(r, "input-nan");
  REQUIRE(in != nullptr);
  CHECK(in->severity == Severity::kError);
  CHECK(in->steps == std::vector<std::int64_t>{1});
  CHECK_THAT(in->evidence, Catch::Contains("1 NaN of 512 values"));
  // Not always the data loader's: an encoder run before the model under no_grad makes such inputs too.
  CHECK_THAT(in->suggestions.front().summary, Catch::Contains("an encoder run before the model"));
  CHECK(find(r, "forward-nonfinite") == nullptr);  // enc only received it
  CHECK(find(r, "overflow-origin") == nullptr);
  REQUIRE(r.skipped.size() == 1);
  CHECK(r.skipped.front().forward == ForwardSource::kInput);
}

TEST_CASE("an Inf in the model's input is named Inf, with the isfinite check, and the collapse points to it",
          "[rules]") {
  // Log power features of silent frames, log(0) computed before the model.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    f.event("input-nan", "argument 0 (float16 [16, 50, 64]): 6208 -Inf of 51200 values").activation("enc", true);
    f.step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* in = find(r, "input-nan");
  REQUIRE(in != nullptr);
  CHECK(in->title == "The model's input already held Inf: none of its modules made the forward non-finite");
  CHECK_THAT(in->suggestions.front().summary, Catch::Contains("a log of 0 in preprocessing"));
  CHECK(in->suggestions.front().python == "assert torch.isfinite(x).all(), \"NaN/Inf in the batch\"");
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK(collapse->suggestions.front().summary ==
        "Fix the Inf in the model's input (see input-nan); the scale recovers once it is gone.");
}

TEST_CASE("a float16 loss is a warning that says the scale cannot pass 65504", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("half-loss", "scaler.scale() received a float16 loss").step(65536, 32768, 1000, {"head.weight"});
  for (int i = 0; i < 4; ++i) f.step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* h = find(r, "half-loss");
  REQUIRE(h != nullptr);
  CHECK(h->severity == Severity::kWarning);
  CHECK_THAT(h->evidence, Catch::Contains("above 65504 (1 step skipped there)"));
  CHECK_THAT(h->suggestions.front().python, Catch::Contains(".float()"));
}

TEST_CASE("a float16 loss's Inf gradient at a scale above 65504 is half-loss's, not the loss's backward", "[rules]") {
  // Its gradient is the scale itself in fp16: Inf at 65536, whatever the loss code.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("half-loss", "scaler.scale() received a float16 loss")
      .event("output-gradient-nonfinite", "float16 [64, 4]: 64 NaN, 192 Inf of 256 values")
      .activation("enc", false)
      .step(65536, 32768, 1000, {"head.weight"});
  for (int i = 0; i < 4; ++i) f.activation("enc", false).step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "loss-backward") == nullptr);
  REQUIRE(find(r, "half-loss") != nullptr);
  CHECK_FALSE(Gate("error").fails(r));
}

TEST_CASE("a run without a float16 loss has no half-loss finding", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "half-loss") == nullptr);
}

TEST_CASE("a NaN loss while every probed module output was finite is made after the modules", "[rules]") {
  // A log(0) or an fp16 sum in the loss: the modules were watched and all finite, so the
  // advice is about the loss, not about recording activations.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).step(65536, 65536);
  f.activation("enc", false).step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.activation("enc", false).step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kError);
  CHECK(fw->module.empty());
  CHECK_THAT(fw->title, Catch::Contains("every probed module's output is finite"));
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains(".float()"));
  CHECK(fw->steps == std::vector<std::int64_t>{1});
  REQUIRE(r.skipped.size() == 1);
  CHECK(r.skipped.front().forward == ForwardSource::kLoss);
}

TEST_CASE("NaN made by the loss's backward is named, not the first layer it reached", "[rules]") {
  // sqrt of a distance from a point to itself: its gradient is NaN at every scale, while the
  // forward and the loss stay finite; the agent saw NaN in the gradient reaching the model's output.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2)
    f.event("output-gradient-nonfinite", "float16 [16, 32]: 512 NaN, 0 Inf of 512 values")
        .activation("enc", false)
        .step(scale, scale / 2, 1000, {"head.weight", "b.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* lb = find(r, "loss-backward");
  REQUIRE(lb != nullptr);
  CHECK(lb->severity == Severity::kError);
  CHECK_THAT(lb->evidence, Catch::Contains("512 NaN, 0 Inf"));
  CHECK_THAT(lb->evidence, Catch::Contains("at loss scales down to 0.0078125, so not the scale"));
  CHECK_THAT(lb->suggestions.front().python, Catch::Contains("+ 1e-12).sqrt()"));
  CHECK(find(r, "overflow-origin") == nullptr);  // head only received it: no pin
  REQUIRE(find(r, "scale-collapse") != nullptr);
  CHECK_THAT(find(r, "scale-collapse")->suggestions.front().summary, Catch::Contains("(see loss-backward)"));
  REQUIRE(r.skipped.size() == 24);
  CHECK(r.skipped.front().forward == ForwardSource::kLossBackward);
}

TEST_CASE("a forward that went NaN/Inf is its module's, whatever reached the model's output after", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.replay("enc", "finite");
  f.event("output-gradient-nonfinite", "float32 [16, 32]: 512 NaN, 0 Inf of 512 values").activation("enc", true);
  f.step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.activation("enc", false).step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "loss-backward") == nullptr);
  REQUIRE(find(r, "forward-nonfinite") != nullptr);
  CHECK(find(r, "forward-nonfinite")->module == "enc");
}
