// overflow-origin with the agent's look at the gradient reaching the named module's output
// (event "module-output-gradient"): where it already held NaN/Inf the code after the module
// made them, and pinning the module alone is not the whole fix.
#include "rule_test.h"

namespace {

// `skips` skipped steps halving the scale from 65536, dec's gradients finite and enc's the
// first NaN/Inf ones each time; the event `seen` for enc at the third. Then `finite` steps.
// `input_from`: events "module-input-from" ("dec: enc": dec's first argument was enc's output).
// `pinned`: modules the run already ran in FP32 (events "pinned-fp32"). `sender`: the
// event "module-gradient-sender" for enc at the fourth ("enc: head": head's backward sent them).
Report entry_run(const std::string& seen, int skips, int finite = 0, const std::vector<std::string>& input_from = {},
                 const std::vector<std::string>& pinned = {}, const std::string& sender = "") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"dec.weight", "enc.weight"});
  for (const auto& from : input_from) f.event("module-input-from", from);
  for (const auto& path : pinned) f.event("pinned-fp32", path);
  double scale = 65536;
  for (int i = 0; i < skips; ++i, scale /= 2) {
    if (i == 2) f.event("module-output-gradient", "enc: " + seen);
    if (i == 3 && !sender.empty()) f.event("module-gradient-sender", "enc: " + sender);
    f.finite_first({"dec.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  for (int i = 0; i < finite; ++i) f.step(scale, scale, 1000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("of two looks at a module's output, the later one says where the NaN/Inf came from",
          "[rules][gradient-entry]") {
  // A log-variance head: its own backward overflowed at the scaler's second skip ("finite"),
  // and the look taken again at a later skip saw NaN/Inf arrive through its output, sent by
  // the exp() of a Gaussian likelihood once the variance was small.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"dec.weight", "enc.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    if (i == 1) f.event("module-output-gradient", "enc: finite");
    if (i == 7) f.event("module-output-gradient", "enc: nonfinite");
    f.finite_first({"dec.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::EndsWith("they reach it through its output: the code that uses enc's output makes them"));
  CHECK_THAT(o.evidence, Catch::Contains("at step 7 the gradient reaching enc's output already held NaN/Inf"));
}

TEST_CASE("a NaN/Inf that reached a module through its output's gradient is blamed on the code after it",
          "[rules][gradient-entry]") {
  // A VAE's encoder output times a gain of 30: the gain's fp16 backward overflows, and enc
  // only receives the Inf. The scale collapses below the floor.
  const Report r = entry_run("nonfinite", 12);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "enc");
  CHECK(o.severity == Severity::kError);
  CHECK_THAT(o.title, Catch::EndsWith("they reach it through its output: the code that uses enc's output makes them"));
  CHECK_THAT(o.evidence, Catch::Contains("at step 2 the gradient reaching enc's output already held NaN/Inf"));
  REQUIRE(o.suggestions.size() == 3);
  // The pin keeps the gradient float32 on its way into enc; autocast off keeps the code's matmuls in FP32 too.
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc in FP32 (pinned: its output, and the gradient it receives"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains("also run the code that uses enc's output in FP32"));
  CHECK_THAT(o.suggestions[2].summary, Catch::Contains("bfloat16"));
  const Finding& c = required(r, "scale-collapse");
  CHECK_THAT(c.suggestions.front().summary, Catch::StartsWith("Fix the NaN/Inf made in the code that uses enc's output"));
}

TEST_CASE("the module after it whose backward ran just before is named, and pinned with it",
          "[rules][gradient-entry]") {
  // A VAE whose enc feeds a Linear `dec` with a gain of 30 in its weights: dec's fp16
  // backward overflows the gradient it sends to enc. enc pinned alone would still receive
  // it from dec's backward, which autocast runs in fp16.
  const Report r = entry_run("nonfinite", 12, 0, {"dec: enc"});
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "enc");
  CHECK_THAT(o.evidence, Catch::Contains("the code that uses enc's output (dec, which is given enc's output and whose "
                                         "backward ran just before enc's, its own gradients finite; the model's own "
                                         "forward() after it"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc and dec in FP32") &&
                                           Catch::Contains("pinned alone, enc would still receive it from dec's backward"));
  CHECK(o.suggestions[0].python == "ampdiag.pin_fp32(model.enc)  # autocast off inside each; float inputs cast\n"
                                   "ampdiag.pin_fp32(model.dec)");
  CHECK_THAT(o.suggestions[0].cpp, Catch::Contains("ampdiag::Fp32Pins pins({\"enc\", \"dec\"});"));
}

TEST_CASE("the module after it is named through a module without parameters between them, and pinned with it",
          "[rules][gradient-entry]") {
  // A GRU's last state through a Dropout into a head whose large weights overflow the
  // gradient its fp16 backward sends back: the Dropout has no gradient to show it ran.
  const Report r = entry_run("nonfinite", 12, 0, {"drop: enc", "dec: drop"});
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("(dec, which is given enc's output through drop and whose backward ran just "
                                         "before enc's, its own gradients finite; the model's own forward() after it"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc and dec in FP32"));
}

TEST_CASE("a module already pinned is not offered its pin again: the module that sends the gradient is",
          "[rules][gradient-entry]") {
  // The MixVAE with enc pinned as the first report said: dec's fp16 backward still hands it the Inf.
  const Report r = entry_run("nonfinite", 12, 0, {"dec: enc"}, {"enc"});
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::EndsWith("; enc already ran in FP32 (pinned), so pinning it is no fix"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run dec in FP32 too: enc is pinned and still receives"));
  CHECK_THAT(o.suggestions[0].python, Catch::StartsWith("ampdiag.pin_fp32(model.dec)"));
}

TEST_CASE("a module already pinned with no module after it to pin is left the code after it to run in FP32",
          "[rules][gradient-entry]") {
  const Report r = entry_run("nonfinite", 12, 0, {}, {"enc"});
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() == 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Where that code runs a matmul or another operation that "
                                                         "autocast puts in fp16 whatever its inputs, run the code "
                                                         "that uses enc's output in FP32"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains("bfloat16"));
}

TEST_CASE("the module that sent the NaN/Inf back is named and pinned, not the one whose backward ran just before",
          "[rules][gradient-entry]") {
  // Two heads on one backbone: dec's backward ran just before enc's, but the agent saw head,
  // given enc's output too, receive a finite gradient and send NaN/Inf back.
  const Report r = entry_run("nonfinite", 12, 0, {"dec: enc"}, {}, "head");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::EndsWith("they reach it through its output: head's backward makes them"));
  CHECK_THAT(o.evidence, Catch::Contains("at step 3 head, given enc's output, received a finite gradient at its own "
                                         "output and sent NaN/Inf back to it: its backward made them in fp16") &&
                             !Catch::Contains("dec, which"));
  REQUIRE(o.suggestions.size() == 2);  // the pin of both covers the code after enc: no autocast-off block
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc and head in FP32"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains("bfloat16"));
  const Finding& c = required(r, "scale-collapse");
  CHECK_THAT(c.suggestions.front().summary, Catch::StartsWith("Fix the NaN/Inf made in head's backward"));
}

TEST_CASE("a module that sent the NaN/Inf back with weights far too large is re-initialised first, its pin kept after",
          "[rules][gradient-entry]") {
  // An LM head 12000 times too large over a decoder: its backward multiplies the gradient it
  // sends into the final norm by its gain, and the layers before take that gradient too, so
  // the norm and the head pinned still collapse the scale (tests/scenarios/test_oversized_sender.py).
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  f.weight_norm("head.weight", 8.0 * 7000.0);  // [64, 64]: a gain of 7000
  const bool enc_pinned = GENERATE(false, true);
  CAPTURE(enc_pinned);
  if (enc_pinned) f.event("pinned-fp32", "enc");
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    if (i == 2) f.event("module-output-gradient", "enc: nonfinite");
    if (i == 3) f.event("module-gradient-sender", "enc: head");
    f.finite_first({"head.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::EndsWith("they reach it through its output: head's backward makes them"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK(o.suggestions[0].summary ==
        "Initialise head at a standard scale (torch's default, Kaiming or Xavier): its weights start at a gain of 7000 "
        "(see oversized-weights), so the gradient its backward sends back to enc is about that many times the one it "
        "receives. Or find what made them this large: a custom initialisation with std=1 on a wide layer, a checkpoint "
        "saved at another scale, a weight multiplied by mistake.");
  // Pinned already, enc is left out of the pin that follows.
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith(enc_pinned ? "Where that gain is by design, run head in FP32 too"
                                                                    : "Where that gain is by design, run enc and head in FP32"));
  CHECK_THAT(o.suggestions[2].summary, Catch::Contains("bfloat16"));
}

namespace {

// `skips` skips halving the scale from 65536, `first`'s gradient the first NaN/Inf one each
// time and judged "finite" at its output (its own backward made them); enc probed before head
// in forward, and `oversized`'s weights read at a gain of 7000. `replay`: the agent's backward
// replay of `first` at the 18th skip, where given.
Report own_overflow_run(const std::string& first, const std::string& oversized, int skips = 12,
                        const std::string& replay = "", const std::string& seen = "finite") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  f.weight_norm(oversized + ".weight", 8.0 * 7000.0);  // [64, 64]
  double scale = 65536;
  for (int i = 0; i < skips; ++i, scale /= 2) {
    f.activation("enc", false, 3.0).activation("head", false, 10.0);
    if (i == 2) f.event("module-output-gradient", first + ": " + seen);
    if (i == 17 && !replay.empty()) f.event("backward-replay", first + ": " + replay);
    f.finite_first({first == "enc" ? "head.weight" : "enc.weight"}).step(scale, scale / 2, 1000, {first + ".weight"});
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a module whose own backward overflowed on gradients that passed through weights far too large after it "
          "gets their re-initialisation first",
          "[rules][gradient-entry]") {
  // An LM head 12000 times too large over a decoder: the down projections' own backward
  // overflows, pinned they only move the overflow to the next layer.
  const Report r = own_overflow_run("enc", "head");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Initialise head at a standard scale (torch's default, Kaiming or Xavier): its weights "
                               "start at a gain of 7000 (see oversized-weights), so the gradients that pass back "
                               "through it, down to enc's, are about that many times larger."));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Where that gain is by design, run enc in FP32"));
  CHECK_THAT(o.suggestions[2].summary, Catch::Contains("bfloat16"));
}

TEST_CASE("a NaN/Inf that reached a module through its output, from code after it that passes the gradient back "
          "through weights far too large, gets their re-initialisation first",
          "[rules][gradient-entry]") {
  // LFM2 with its tied LM head 3e4 times too large: the gradient reaching the last
  // feed-forward's output overflowed in the model's own code after it (a residual add, the
  // final norm, the head), and the report had led with the feed-forward's pin.
  const Report r = own_overflow_run("enc", "head", 12, "", "nonfinite");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::Contains("they reach it through its output"));
  REQUIRE(o.suggestions.size() >= 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise head at a standard scale"));
  CHECK_THAT(o.suggestions[0].summary, Catch::Contains("down to enc's"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Where that gain is by design, run enc in FP32 (pinned"));
}

TEST_CASE("a backward NaN at every scale yet finite replayed in FP32, on gradients that passed through weights far "
          "too large after it, gets their re-initialisation first",
          "[rules][gradient-entry]") {
  // Hugging Face's DETR with its class head 3e4 times too large: its first decoder layer went
  // NaN/Inf first down to a scale of 0.125, finite in FP32, and was told only to be pinned.
  const Report r = own_overflow_run("enc", "head", 20, "finite: float16 autocast: NaN/Inf in 1 of 1 gradients; FP32: 0");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::EndsWith("in FP32 its backward is finite (replayed)"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise head at a standard scale"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Where that gain is by design, run enc in FP32"));
}

TEST_CASE("weights far too large before the module whose own backward overflowed leave its pin first",
          "[rules][gradient-entry]") {
  // Its gradients did not pass back through them.
  const Report r = own_overflow_run("head", "enc");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run head in FP32"));
}

// A LibTorch CNN whose modules no agent.forward() ran (no module rows): 10 skips halving the
// scale from 65536, features.5's gradient (a BatchNorm) the first NaN/Inf one each time, after
// the finite gradients of `before` (modules, in backward order); `oversized`'s weights read at
// a gain of 17000.
Report unprobed_run(const std::vector<std::string>& before, const std::string& oversized) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"features.0.weight", "features.5.weight", "features.6.weight", "fc.weight"}, 0, 1,
               "float32", {{"features.5.weight", "BatchNorm2d"}, {"features.0.weight", "Conv2d"}});
  f.weight_norm(oversized + ".weight", 8.0 * 17000.0);  // [64, 64]
  std::vector<std::string> finite;
  for (const auto& module : before) finite.push_back(module + ".weight");
  double scale = 65536;
  for (int i = 0; i < 10; ++i, scale /= 2) f.finite_first(finite).step(scale, scale / 2, 1000, {"features.5.weight"});
  f.finish();
  return report_of(dir.file("run.db"));
}

TEST_CASE("without module rows, weights far too large in the module whose backward ran just before get their "
          "re-initialisation first",
          "[rules][gradient-entry]") {
  // fc 17000 times too large: its backward sends the BatchNorm before it gradients that
  // overflow, and the BatchNorm's pin would not touch them.
  const Report r = unprobed_run({"fc"}, "fc");
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "features.5");
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Initialise fc at a standard scale (torch's default, Kaiming or Xavier): its weights "
                               "start at a gain of 17000 (see oversized-weights), so the gradients that pass back "
                               "through it, down to features.5's, are about that many times larger."));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Where that gain is by design, run features.5 in FP32"));
}

TEST_CASE("without module rows, weights far too large in a module whose backward ran earlier, not just before, get "
          "their re-initialisation first",
          "[rules][gradient-entry]") {
  // fc's gradient arrives first, then features.6's, then features.5's NaN/Inf one.
  const Report r = unprobed_run({"fc", "features.6"}, "fc");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise fc at a standard scale"));
}

TEST_CASE("without module rows, weights far too large in a module whose backward did not run before leave the pin "
          "first",
          "[rules][gradient-entry]") {
  // features.0 runs before features.5 in forward: its gain does not reach features.5's gradients.
  const Report r = unprobed_run({"fc"}, "features.0");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run features.5 in FP32"));
}

TEST_CASE("several modules that sent the NaN/Inf back are all named, the first pinned with the module",
          "[rules][gradient-entry]") {
  const Report r = entry_run("nonfinite", 12, 0, {}, {}, "head, aux");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, Catch::Contains("head (then aux), given enc's output, received a finite gradient") &&
                             Catch::Contains("their backward made them"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Run enc and head in FP32") && Catch::EndsWith(" aux sent them too: it is pinned with them."));
  CHECK(o.suggestions[0].python == "ampdiag.pin_fp32(model.enc)  # autocast off inside each; float inputs cast\n"
                                   "ampdiag.pin_fp32(model.head)\nampdiag.pin_fp32(model.aux)");
  CHECK_THAT(o.suggestions[0].cpp, Catch::Contains("ampdiag::Fp32Pins pins({\"enc\", \"head\", \"aux\"});"));
}

TEST_CASE("a module already pinned is offered the pin of the module that sent the NaN/Inf back",
          "[rules][gradient-entry]") {
  const Report r = entry_run("nonfinite", 12, 0, {"dec: enc"}, {"enc"}, "head");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run head in FP32 too: enc is pinned"));
}

TEST_CASE("a module whose backward ran just before but was given another module's output is not named",
          "[rules][gradient-entry]") {
  // A VAE's decoder: its backward runs before the encoder's, but it takes the sampled z, and
  // the gain in the model's forward() between them is what overflows.
  const Report r = entry_run("nonfinite", 12, 0, {"dec: proj"});
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, !Catch::Contains("dec, which"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc in FP32 (pinned: its output"));
}

TEST_CASE("a module whose output's gradient was finite made the NaN/Inf itself: its pin stays",
          "[rules][gradient-entry]") {
  const Report r = entry_run("finite", 12);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::StartsWith("enc overflows first in backward"));
  CHECK_THAT(o.evidence, Catch::Contains("at step 2 the gradient reaching its output was finite: its own backward made them"));
  REQUIRE(o.suggestions.size() == 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run enc in FP32:"));
}

TEST_CASE("calibration skips whose NaN/Inf came in through the output stay information",
          "[rules][gradient-entry]") {
  const Report r = entry_run("nonfinite", 4, 200);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.severity == Severity::kInfo);
  CHECK_THAT(o.title, Catch::Contains("the loss scale copes with it"));
  CHECK_THAT(o.evidence, Catch::Contains("already held NaN/Inf"));
  CHECK(o.suggestions.empty());
}

TEST_CASE("a NaN that reached a module through its output at every scale gets the look at the backward, no pin",
          "[rules][gradient-entry]") {
  // Down to a scale below 1, where no scale enlarges a gradient: sqrt(0)'s in the code after enc.
  const Report r = entry_run("nonfinite", 24);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::Contains("at every loss scale"));
  CHECK_THAT(o.evidence, Catch::Contains("already held NaN/Inf") && !Catch::Contains("fp16 backward"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Look first at the backward of enc"));
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::Contains("Run enc in FP32"));
}

TEST_CASE("a module holding every layer (DistributedDataParallel's \"module\") is not where the backward overflowed",
          "[rules][gradient-entry]") {
  // A model attached in its DDP wrapper: every layer is under "module.". The classifier's
  // gradients were the last finite ones before the backbone's first NaN/Inf: their common
  // module is the wrapper's "module", the whole model, so the backbone's layer names it.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"module.cls.weight", "module.backbone.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.finite_first({"module.cls.weight"}).step(scale, scale / 2, 1000, {"module.backbone.weight"});
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "module.backbone");
}

TEST_CASE("at every loss scale the look at the backward starts with the module that sent the NaN back",
          "[rules][gradient-entry]") {
  // A head whose backward takes sqrt(0)'s gradient, given enc's output: NaN at any scale.
  const Report r = entry_run("nonfinite", 24, 0, {}, {}, "head");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::Contains("at every loss scale"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Look first at the backward of head, enc:"));
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::Contains("Run enc"));
}

namespace {

// enc's gradients first NaN/Inf in `skips` skips halving the scale from 65536, sent through
// its output by `sender`, a probed module without parameters defined at `source` (DANN's
// gradient reversal).
Report parameterless_sender_run(const std::string& sender, const std::string& source, int skips = 12) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"dec.weight", "enc.weight"});
  f.module_source(sender, source);
  double scale = 65536;
  for (int i = 0; i < skips; ++i, scale /= 2) {
    if (i == 2) f.event("module-output-gradient", "enc: nonfinite");
    if (i == 3) f.event("module-gradient-sender", "enc: " + sender);
    f.activation("enc", false).activation(sender, false).activation("dec", false);
    f.finite_first({"dec.weight"}).step(scale, scale / 2, 1000, {"enc.weight"});
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a sender without parameters has its backward code looked at before any other fix", "[rules][gradient-entry]") {
  const Report r = parameterless_sender_run("grl", "/work/dann.py:13");
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "enc");
  CHECK_THAT(o.evidence, Catch::Contains("at step 3 grl, given enc's output, received a finite gradient at its own output "
                                         "and sent NaN/Inf back to it"));
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Look at grl's backward: it holds no parameters, so what "
                                                         "enlarges the gradient it sends back to enc is its own code"));
  CHECK(o.suggestions[0].untried);
}

TEST_CASE("one of torch's own modules without parameters as the sender gets no look at its code", "[rules][gradient-entry]") {
  const Report r = parameterless_sender_run("act", "/venv/lib/python3.11/site-packages/torch/nn/modules/activation.py:700");
  const Finding& o = required(r, "overflow-origin");
  for (const Suggestion& s : o.suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("Look at act's backward"));
}

TEST_CASE("a sender without parameters whose NaN/Inf came at every scale is looked at for a singular gradient",
          "[rules][gradient-entry]") {
  // A pairwise distance written as a module: sqrt(0)'s gradient at every scale, not a gain.
  const Report r = parameterless_sender_run("dist", "/work/model.py:40", 24);
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Look first at the backward of dist, enc"));
  for (const Suggestion& s : o.suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("Look at dist's backward"));
}
