// A loss too large for fp16 (gradients too large for a loss scale above the floor): whether
// the report points at the targets, at the model's large outputs and where they jump, or at
// weights that started far too large.
#include "rule_test.h"

namespace {

// 30 steps with a loss of 9e10: the first 20 skipped, head.weight first NaN/Inf, the scale
// halving from 65536; the last 10 finite at the scale reached. enc and head probed, enc's
// outputs reaching 3 and head's `head_output`; with a
// module "mid" between them whose outputs reach `mid_output`, where given; and with an
// expert between them first called at step 5 (its outputs `late_expert`, head's 10 before it),
// where given; with the weights of `oversized` (enc.weight or head.weight) read at step 0 at a
// gain of `gain` ([64, 64]: l2 = 8 * gain), the other's at 0.3, where given. Not `probed`: no
// module's output recorded at all (a LibTorch model no agent.probe() watched). With the
// loss code `loss_code` read at step 0, where given.
Report loss_too_large_run(double head_output, double mid_output = 0.0, double late_expert = 0.0, double gain = 0.0,
                          const std::string& oversized = "head.weight", bool probed = true,
                          const std::string& loss_code = "") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  if (!loss_code.empty()) f.event("loss-code", loss_code);
  if (gain > 0.0)
    for (const char* layer : {"enc.weight", "head.weight"}) f.weight_norm(layer, layer == oversized ? 8.0 * gain : 2.4);
  double scale = 65536;
  for (int i = 0; i < 30; ++i) {
    if (probed) f.activation("enc", false, 3.0);
    if (mid_output > 0.0) f.activation("mid", false, mid_output);
    if (late_expert > 0.0 && i >= 5) f.activation("experts.3", false, late_expert);
    if (probed) f.activation("head", false, late_expert > 0.0 && i < 5 ? 10.0 : head_output);
    if (i < 20) {
      f.step(scale, scale / 2, 1000, {"head.weight"}, 9e10);
      scale /= 2;
    } else {
      f.step(scale, scale, 37000, {}, 9e10);
    }
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a loss too large for fp16 with small model outputs points at the targets", "[rules]") {
  // Outputs around 10 against a loss of 9e10: the targets (or a sum) make it, not the model.
  const Report r = loss_too_large_run(10.0);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.suggestions[0].summary, Catch::Contains(": normalise the regression targets to unit spread, average"));
  CHECK_THAT(o.suggestions[0].summary, !Catch::Contains("outputs"));
}

TEST_CASE("a loss too large for fp16 that its code multiplies by a large factor is told to take the factor out",
          "[rules]") {
  // A cross-entropy times 1e6 "to keep small gradients from underflowing", on top of the
  // GradScaler: the loss is around 2.3e6 and its gradients as large.
  const Report r = loss_too_large_run(10.0, 0.0, 0.0, 0.0, "head.weight", true,
                                      "ToCopy:float32, LogSoftmax:float32, NllLoss(mean):float32, Mul(1e+06):float32");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK(o.suggestions[0].summary.rfind("Take out the loss code's multiplication by 1e+06 (Mul, float32), which makes "
                                       "every gradient 1e+06 times larger: the loss is around 9e+10 with it, about "
                                       "90000 without.", 0) == 0);
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Shrink the loss where it is made"));
}

TEST_CASE("a class-index loss too large for fp16 is not told to normalise regression targets", "[rules]") {
  const Report r = loss_too_large_run(10.0, 0.0, 0.0, 0.0, "head.weight", true,
                                      "ToCopy:float32, LogSoftmax:float32, NllLoss(mean):float32, Mul(1e+06):float32");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains(": its targets are class indices, which no normalisation "
                                                       "shrinks; average over the batch instead of summing"));
  CHECK(o.suggestions[1].python.empty());
}

TEST_CASE("a loss too large for fp16 whose code scales it by a small factor is not told to take it out", "[rules]") {
  // A mean over 4 accumulated micro-batches (Div(4)), a weight of 2: not what makes it large.
  const Report r = loss_too_large_run(10.0, 0.0, 0.0, 0.0, "head.weight", true,
                                      "ToCopy:float32, MseLoss(mean):float32, Mul(2):float32, Div(4):float32");
  for (const auto& s : required(r, "overflow-origin").suggestions) CHECK_THAT(s.summary, !Catch::Contains("Take out"));
}

TEST_CASE("a loss too large for fp16 whose code multiplies by T * T after dividing by T is not told to take it out",
          "[rules]") {
  // Distillation's soft term, kl_div(log_softmax(s / 4), ...) * 16: together a factor of 4,
  // while the gradients are about 9 times what the scale holds; without it they still would
  // not fit.
  const Report r = loss_too_large_run(10.0, 0.0, 0.0, 0.0, "head.weight", true,
                                      "Div(4):float32, LogSoftmax:float32, KlDiv:float32, Mul(16):float32");
  for (const auto& s : required(r, "overflow-origin").suggestions) CHECK_THAT(s.summary, !Catch::Contains("Take out"));
}

TEST_CASE("a loss too large for fp16 where no module output was probed names both readings", "[rules]") {
  // A LibTorch classifier whose head starts 17000 times too large makes a cross-entropy of
  // 10760: without the outputs, large targets are only one of two readings.
  const Report r = loss_too_large_run(0.0, 0.0, 0.0, 0.0, "head.weight", false);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.suggestions[0].summary,
             Catch::Contains("; no module output was probed to say whether the model's outputs are that large: where "
                             "the targets are, normalise them to unit spread, and where they are not, find what makes "
                             "the outputs so large"));
  CHECK_THAT(o.suggestions[0].summary, !Catch::Contains("regression targets"));
}

TEST_CASE("a loss too large for fp16 where no module output was probed leads with the re-initialisation of weights "
          "far too large after it",
          "[rules]") {
  // head's own weights: its gain makes its outputs, the loss and their gradients that large.
  const Report r = loss_too_large_run(0.0, 0.0, 0.0, 4818.0, "head.weight", false);
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise head at a standard scale"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Shrink the loss where it is made"));
}

TEST_CASE("a loss too large for fp16 where no module output was probed gets no re-initialisation of weights before "
          "it",
          "[rules]") {
  // enc's gradients arrive after head's NaN/Inf one: nothing says head's pass through it.
  const Report r = loss_too_large_run(0.0, 0.0, 0.0, 1768.0, "enc.weight", false);
  for (const auto& s : required(r, "overflow-origin").suggestions) CHECK_THAT(s.summary, !Catch::Contains("Initialise"));
}

TEST_CASE("a loss too large for fp16 with large model outputs names them beside the targets", "[rules]") {
  // A head initialised 1e4 times too large on unit targets gives the same loss: normalising
  // the targets alone would not help, and the report cannot tell the two apart.
  const Report r = loss_too_large_run(2e5);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.suggestions[0].summary,
             Catch::Contains("the model's outputs are large too (head's, the last module's, reach 200000): where the "
                             "targets are that large, normalise them") &&
                 Catch::Contains("find what makes the outputs so large"));
}

TEST_CASE("a loss too large for fp16 from a head whose weights start far too large is fixed at its initialisation first",
          "[rules]") {
  // An LM head initialised 3e4 times too large: logits of 2e4 from a loss over token ids,
  // where no target normalisation helps.
  const Report r = loss_too_large_run(2e5, 0.0, 0.0, 4818.0);
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Initialise head at a standard scale (torch's default, Kaiming or Xavier): its weights "
                               "start at a gain of 4818 (see oversized-weights), so its outputs reach 200000"));
  CHECK_THAT(o.suggestions[0].python, Catch::StartsWith("model.get_submodule(\"head\").reset_parameters()  # torch's "
                                                        "default initialisation (Linear, Conv)"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Shrink the loss where it is made"));
  // oversized-weights gives the same re-initialisation, without the why the overflow's fix says.
  const Finding* w = find(r, "oversized-weights");
  REQUIRE(w != nullptr);
  REQUIRE_FALSE(w->suggestions.empty());
  CHECK(w->suggestions[0].python == o.suggestions[0].python);
  CHECK_THAT(w->suggestions[0].summary, Catch::StartsWith("Initialise head at a standard scale (torch's default, "
                                                          "Kaiming or Xavier), or find what made its weights this large"));
}

TEST_CASE("a loss too large for fp16 after a layer whose weights start far too large is fixed at that layer first",
          "[rules]") {
  // A classifier's first convolution 3000 times too large: every output after it is large,
  // the head's included, though the head's own weights are standard.
  const Report r = loss_too_large_run(2e5, 0.0, 0.0, 1768.0, "enc.weight");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary,
             Catch::StartsWith("Initialise enc at a standard scale (torch's default, Kaiming or Xavier): its weights "
                               "start at a gain of 1768 (see oversized-weights), so what it makes is about that many "
                               "times its input, and the loss (around 9e+10) and the gradients of the layers after it "
                               "are as large"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("Shrink the loss where it is made"));
}

TEST_CASE("a loss too large for fp16 with small model outputs points at the targets, whatever gain a layer has",
          "[rules]") {
  // Outputs around 10 against a loss of 9e10: the targets make the loss, not enc's gain.
  const Report r = loss_too_large_run(10.0, 0.0, 0.0, 1768.0, "enc.weight");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.suggestions[0].summary, Catch::Contains(": normalise the regression targets to unit spread, average"));
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::Contains("Initialise"));
}

TEST_CASE("a loss too large for fp16 with no oversized weights offers no re-initialisation", "[rules]") {
  const Report r = loss_too_large_run(2e5, 0.0, 0.0, 1.0);  // both layers read at standard gains
  for (const auto& s : required(r, "overflow-origin").suggestions) CHECK_THAT(s.summary, !Catch::Contains("Initialise"));
}

TEST_CASE("the model's outputs are its head's even where an expert was first called after it", "[rules]") {
  // A mixture of experts: an expert first routed to at step 5 gets a module id after the
  // head's, though it finishes before the head in every forward.
  const Report r = loss_too_large_run(2e5, 0.0, 0.5);  // head's outputs 10 before step 5: still the largest
  CHECK_THAT(required(r, "overflow-origin").suggestions[0].summary,
             Catch::Contains("the model's outputs are large too (head's, the last module's, reach 200000)"));
}

TEST_CASE("a loss too large for fp16 names an expert first called after the head where the outputs jump", "[rules]") {
  // The jump is read in each forward: by module ids, the expert would come after the head,
  // whose outputs are larger than its own.
  const Report r = loss_too_large_run(2e5, 0.0, 30000.0);
  CHECK_THAT(required(r, "overflow-origin").suggestions[0].summary,
             Catch::Contains("find what makes the outputs so large: experts.3's reach 30000, 10000 times the largest "
                             "output of any module before it in forward order"));
}

TEST_CASE("a loss too large for fp16 names the module where the outputs jump", "[rules]") {
  // A frozen encoder's projection 1e4 times too large: its outputs reach 30000 from inputs
  // of at most 3, and the head after it makes them larger still.
  const Report r = loss_too_large_run(2e5, 30000.0);
  CHECK_THAT(required(r, "overflow-origin").suggestions[0].summary,
             Catch::Contains("find what makes the outputs so large: mid's reach 30000, 10000 times the largest output "
                             "of any module before it in forward order"));
}

TEST_CASE("a loss too large for fp16 whose outputs jump inside the model before a small head names that module, "
          "not the targets",
          "[rules]") {
  // DETR's class head 3e4 times too large: logits up to 11096 under a loss of 5360, before a
  // box head whose outputs are sigmoid-bound; told to normalise its regression targets.
  const Report r = loss_too_large_run(10.0, 30000.0);
  const Suggestion& fix = required(r, "overflow-origin").suggestions[0];
  CHECK_THAT(fix.summary, Catch::Contains("; inside the model the outputs are large: mid's reach 30000, 10000 times the "
                                          "largest output of any module before it in forward order"));
  CHECK_THAT(fix.summary, !Catch::Contains("regression targets"));
  CHECK(fix.python.empty());
}

TEST_CASE("gradients that overflow at the floor itself and fit only below it are too large for the scale", "[rules]") {
  // The last skip at a scale of 128 left it at 64, where the gradients (up to 37000 / 64) fit:
  // a scale settled below the floor, as one that overflowed at 64 would have.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 10; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"}, 900);
  for (int i = 0; i < 10; ++i) f.step(scale, scale, 37000, {}, 900);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.title == "head's gradients are too large for a loss scale above the floor of 128 (up to 578.125 unscaled)");
}

namespace {

// The same skips down to 64 with a loss of `loss` each step, where the agent's look at step 1
// found the gradient reaching head's output already NaN/Inf.
Report entered_below_floor_run(double loss) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 10; ++i, scale /= 2) {
    if (i == 1) f.event("module-output-gradient", "head: nonfinite");
    f.step(scale, scale / 2, 1000, {"head.weight"}, loss);
  }
  for (int i = 0; i < 10; ++i) f.step(scale, scale, 37000, {}, loss);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("gradients too large for the scale that entered through the output of a loss of their size are the loss's",
          "[rules]") {
  // PPO's value loss on returns of 500, around 125000: the value head's gradient overflowed
  // at its output at high scales, and its own sum over the batch down to 128.
  const Report r = entered_below_floor_run(125000);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.title == "head's gradients are too large for a loss scale above the floor of 128 (up to 578.125 unscaled)");
  CHECK_THAT(o.evidence, Catch::Contains("; at step 1 the gradient reaching head's output already held NaN/Inf: the "
                                         "loss's own, which a loss around 125000 makes about that large"));
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Shrink the loss where it is made (it is around 125000"));
}

TEST_CASE("gradients that entered through the output of an ordinary loss are the code after the module's", "[rules]") {
  // A loss around 2 sends gradients of ~3 at most: a gain after the module made them large.
  const Report r = entered_below_floor_run(2.0);
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::EndsWith("they reach it through its output: the code that uses head's output makes them"));
}

namespace {

// A decoder stack named for its skips (its first NaN/Inf gradient dec.mlp.weight's, the
// finite one before it its final norm's) whose last skip left the scale at 64, below the
// floor; in the 10 finite steps after, the unscaled gradients of dec.mlp are 1000 / 64 and
// those of `large` (a layer under dec) 40 times that, 625.
Report decoder_stack_run(const std::string& large) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"dec.embed.weight", "dec.attn.weight", "dec.mlp.weight", "dec.norm.weight",
                                    "head.weight"},
               0, 1, "float32", {{"dec.embed.weight", "Embedding"}, {"dec.norm.weight", "RMSNorm"}});
  f.absmax_times(large, 40.0);
  double scale = 65536;
  for (int i = 0; i < 10; ++i, scale /= 2)
    f.finite_first({"head.weight", "dec.norm.weight"}).step(scale, scale / 2, 1000, {"dec.mlp.weight"}, 900);
  for (int i = 0; i < 10; ++i) f.step(scale, scale, 1000, {}, 900);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a module first by a layer whose gradients fit is too large for the scale where another of its layers' are not",
          "[rules]") {
  // A Qwen2 LM whose lm_head starts 3e4 times too large: Qwen2Model is named, by a
  // down_proj whose gradients fit at 128, while its v_proj's reach 4442.
  const Report r = decoder_stack_run("dec.attn.weight");
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "dec");
  CHECK(o.title == "dec's gradients are too large for a loss scale above the floor of 128 (up to 625 unscaled)");
  CHECK_THAT(o.evidence, Catch::Contains("the largest unscaled one was 625 (dec.attn.weight, step 10)"));
}

TEST_CASE("a normalisation layer's or a float32 embedding's large gradients are not a module's too large for the scale",
          "[rules]") {
  // Autocast computes both in FP32: their size bounds no loss scale.
  for (const std::string large : {"dec.norm.weight", "dec.embed.weight"}) {
    CAPTURE(large);
    const Report r = decoder_stack_run(large);
    const Finding& o = required(r, "overflow-origin");
    CHECK_THAT(o.title, !Catch::Contains("too large for a loss scale"));
  }
}

TEST_CASE("a loss over class indices with large model outputs names the outputs and no target normalisation", "[rules]") {
  // An LM whose lm_head starts 3e4 times too large, its cross-entropy computed in the model.
  const Report r = loss_too_large_run(2e5, 0.0, 0.0, 0.0, "head.weight", true,
                                      "ToCopy:float32, LogSoftmax:float32, NllLoss(mean of 184):float32, Div(1):float32");
  const Finding& o = required(r, "overflow-origin");
  const auto shrink = std::find_if(o.suggestions.begin(), o.suggestions.end(), [](const Suggestion& s) {
    return s.summary.rfind("Shrink the loss where it is made", 0) == 0;
  });
  REQUIRE(shrink != o.suggestions.end());
  CHECK_THAT(shrink->summary, Catch::Contains("the model's outputs are large (head's, the last module's, reach 200000) "
                                              "and its targets are class indices, which no normalisation shrinks") &&
                                  !Catch::Contains("normalise them"));
  CHECK(shrink->python.empty());
}
