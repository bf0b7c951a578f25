// The module an FP32 replay confirms or clears: where a NaN/Inf in forward is pinned, and where
// it is a mask's -inf or the caller's code (one situation per test; a buffer's NaN/Inf is
// test_rules_buffers.cpp's).
#include <cstdio>

#include "rule_test.h"

TEST_CASE("a module whose FP32 replay is still NaN/Inf is never the pin: the parent whose replay is finite is", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"block.conv2.weight", "block.bn2.weight"});
  f.replay("block.bn2", "nonfinite").replay("block", "finite");
  for (int i = 0; i < 4; ++i) f.activation("block.conv2", false).activation("block.bn2", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "block");
  CHECK(fw->confirmation == "confirmed");
  CHECK_THAT(fw->title, Catch::EndsWith("in its own code, between block.conv2 and block.bn2"));
  for (const auto& finding : r.findings)
    for (const auto& s : finding.suggestions) CHECK_THAT(s.python, !Catch::Contains("block.bn2") && !Catch::Contains("bn2)"));
  CHECK(r.skipped.front().forward_module == "block");
}

TEST_CASE("the model's own code that made NaN/Inf is placed after the module that finished just before", "[rules][replay]") {
  // A VAE's reparameterisation, exp(0.5 * logvar) in fp16, runs in the model's forward()
  // between logvar and the decoder's first layer, which only receives its Inf.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"mu.weight", "logvar.weight", "dec.0.weight"});
  f.replay("dec.0", "nonfinite").replay("dec", "nonfinite");
  for (int i = 0; i < 4; ++i)
    f.activation("mu", false).activation("logvar", false).activation("dec.0", true).activation("dec", true)
        .step(65536, 32768, 1000, {"dec.0.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module.empty());
  CHECK_THAT(fw->title, Catch::EndsWith("outside its submodules, between logvar and dec.0"));
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0:"));
}

namespace {

// The VAE run above, with the agent's read of the code that made dec.0's input (`code`).
Report vae_with_input_code(const TempDir& dir, const std::string& code) {
  RunFixture f(dir.file("run.db"), {"mu.weight", "logvar.weight", "dec.0.weight"});
  f.replay("dec.0", "nonfinite").replay("dec", "nonfinite");
  for (int i = 0; i < 4; ++i) {
    if (i == 0) f.event("input-code", "dec.0: " + code);
    f.activation("mu", false).activation("logvar", false).activation("dec.0", true).activation("dec", true)
        .step(65536, 32768, 1000, {"dec.0.weight"}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("the model's own code that made NaN/Inf has its exp() computed in FP32 and bounded first", "[rules][replay]") {
  TempDir dir;
  const Report r = vae_with_input_code(dir, "Mul:float16, Exp:float16, Mul:float16, Add:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::EndsWith("; the code that made dec.0's input, read at step 0: Mul, Exp, Mul, Add (all "
                                          "float16)"));
  REQUIRE(fw.suggestions.size() >= 2);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Bound what the model's own forward() passes to exp() between "
                                                          "logvar and dec.0 (Exp, float16)") &&
                                            Catch::Contains("Compute it in FP32, its argument clamped"));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("torch.exp(x.float().clamp(max=20))"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0"));
}

TEST_CASE("the model's own code whose exp() ran in float32 has its argument clamped, not cast", "[rules][replay]") {
  TempDir dir;
  const Report r = vae_with_input_code(dir, "Mul:float32, Exp:float32, Mul:float32, Add:float32");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::Contains("(Exp, float32)") && Catch::Contains("Clamp its argument") &&
                                            !Catch::Contains("Compute it in FP32"));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("torch.exp(x.clamp(max=80))"));
}

TEST_CASE("the model's own code without an exp keeps the look at it first, its operations listed", "[rules][replay]") {
  TempDir dir;
  const Report r = vae_with_input_code(dir, "Mul:float16, Div:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::Contains("Mul, Div (all float16)"));
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0"));
}

TEST_CASE("the model's own code that divides by a small constant in float16 is told to divide in FP32 first",
          "[rules][replay]") {
  TempDir dir;  // F.gumbel_softmax(logits, tau=1e-4) between an encoder and a codebook
  const Report r = vae_with_input_code(dir, "Add:float16, Div(0.0001):float16, Softmax:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::Contains("Add, Div, Softmax (all float16)"));
  REQUIRE(fw.suggestions.size() >= 2);
  CHECK_THAT(fw.suggestions[0].summary,
             Catch::StartsWith("Compute in FP32 what the model's own forward() divides between logvar and dec.0: in "
                               "float16 the division by 0.0001 (Div) multiplies what it divides by 10000, so every value "
                               "above 6.55 passes fp16's 65504"));
  CHECK_THAT(fw.suggestions[0].python, Catch::StartsWith("y = x.float() / tau"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0"));
}

TEST_CASE("a constant that shrinks its input, one in float32, a small one, or one beside a log is no reason to compute "
          "in FP32", "[rules][replay]") {
  TempDir dir;
  for (const char* code : {"Mul(0.5):float16, Add:float16", "Div(4):float16, Add:float16", "Div(0.0001):float32, Add:float32",
                           "Mul(2):float16, Add:float16", "Div(0.0001):float16, Log:float16"}) {
    const Report r = vae_with_input_code(dir, code);
    const Finding& fw = required(r, "forward-nonfinite");
    REQUIRE_FALSE(fw.suggestions.empty());
    CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Look at the model's own forward() between logvar and dec.0"));
    std::remove(dir.file("run.db").c_str());
  }
}

TEST_CASE("an exp() in the model's own code comes before the multiplication by a constant that feeds it", "[rules][replay]") {
  TempDir dir;
  const Report r = vae_with_input_code(dir, "Mul(100):float16, Exp:float16, Add:float16");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.suggestions.size() >= 3);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Bound what the model's own forward() passes to exp()"));
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Compute in FP32 what the model's own forward() multiplies") &&
                                            Catch::Contains("the multiplication by 100 (Mul) multiplies its input by 100"));
  CHECK_THAT(fw.suggestions[1].python, Catch::StartsWith("y = x.float() * c"));
}

namespace {

// The title of the run's forward-nonfinite finding; the test fails where there is none.
std::string forward_nonfinite_title(const std::string& db) {
  const auto r = report_of(db);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  return fw->title;
}

}  // namespace

TEST_CASE("the model's own code is placed after the module that finished just before, in a branch first taken later", "[rules][replay]") {
  // The decoder runs from step 2 on only: its modules' ids come after head's, which finished
  // after logvar in the first steps.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"mu.weight", "logvar.weight", "head.weight", "dec.0.weight"});
  f.replay("dec.0", "nonfinite").replay("dec", "nonfinite");
  for (int i = 0; i < 6; ++i) {
    f.activation("mu", false).activation("logvar", false);
    if (i < 2) f.activation("head", false).step(65536, 65536, 1000, {}, 1.0);
    else f.activation("dec.0", true).activation("dec", true).step(65536, 32768, 1000, {"dec.0.weight"}, kNaN);
  }
  f.finish();
  CHECK_THAT(forward_nonfinite_title(dir.file("run.db")), Catch::EndsWith("outside its submodules, between logvar and dec.0"));
}

TEST_CASE("the model's own code is placed from a forward with every call's row, not from one with NaN/Inf rows only", "[rules][replay]") {
  // Activations sampled every other step: the odd steps have rows only for NaN/Inf outputs,
  // so at step 1, where dec.0 is first NaN/Inf, no row finished before it.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"mu.weight", "logvar.weight", "dec.0.weight"});
  f.meta("every", "1").meta("activation_every", "2");
  f.replay("dec.0", "nonfinite").replay("dec", "nonfinite");
  for (int i = 0; i < 6; ++i) {
    if (i % 2 == 0) f.activation("mu", false).activation("logvar", false);
    if (i == 0) f.activation("dec.0", false).activation("dec", false).step(65536, 65536, 1000, {}, 1.0);
    else f.activation("dec.0", true).activation("dec", true).step(65536, 32768, 1000, {"dec.0.weight"}, kNaN);
  }
  f.finish();
  CHECK_THAT(forward_nonfinite_title(dir.file("run.db")), Catch::EndsWith("outside its submodules, between logvar and dec.0"));
}

TEST_CASE("the model's output NaN/Inf after finite modules names its own code after the last one, with its operations", "[rules][replay]") {
  // A log-sum-exp written by hand after the last module: the Python agent records the
  // model's output as module "" with its FP32 replay, and the operations (model-code).
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"body.weight", "norm.weight"});
  f.replay("", "finite");
  for (int i = 0; i < 4; ++i) {
    if (i == 0) f.event("model-code", "Exp:float16, Sum:float16, Log:float16");
    f.activation("body", false).activation("norm", false).activation("", true).step(65536, 32768, 1000, {"norm.weight"}, kNaN);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module.empty());
  CHECK(fw->confirmation == "confirmed");
  CHECK_THAT(fw->title, Catch::EndsWith("its own forward() makes it after norm, its last submodule"));
  CHECK_THAT(fw->evidence, Catch::Contains("from norm's output to the model's (step 0): Exp, Sum, Log (all float16)"));
  CHECK_THAT(fw->suggestions.front().summary,
             Catch::StartsWith("Run the model's own code after norm, its last submodule (Exp, Sum and Log) in FP32"));
  for (const auto& x : r.findings) CHECK_THAT(x.title, !Catch::Contains("made after the modules"));
}

// CLIP: logits = logit_scale.exp() * image @ text.T, its model-parameters event `parameters`.
Report clip_report(const std::string& parameters) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"image.weight", "text.weight", "logit_scale"});
  f.replay("", "finite");
  for (int i = 0; i < 4; ++i) {
    if (i == 0) f.event("model-code", "Div:float16, T:float16, Mm:float16").event("model-parameters", parameters);
    f.activation("image", false).activation("text", false).activation("", true).step(65536, 32768, 1000,
                                                                                     {"logit_scale"}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

TEST_CASE("the model's own parameters that its code after the modules reads are in the evidence", "[rules][replay]") {
  // logit_scale initialised to 1/0.07 instead of its log: the parameter, not the matmul,
  // makes the overflow.
  const auto r = clip_report("logit_scale: 14.29 (float32, 1 value), read by Exp");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("the model's own parameters (held by no submodule) that code reads: "
                                           "logit_scale: 14.29 (float32, 1 value), read by Exp"));
}

TEST_CASE("a parameter whose exp() passes fp16's range by itself is bounded first, before the code runs in FP32",
          "[rules][replay]") {
  const auto r = clip_report("proj: |x| up to 0.5 (float32, 1024 values), read by Mm; logit_scale: 14.29 (float32, 1 "
                             "value), read by Exp");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  REQUIRE(fw->suggestions.size() >= 2);
  CHECK_THAT(fw->suggestions[0].summary, Catch::StartsWith("Bound logit_scale before its exp(): at 14.3, exp() gives "
                                                           "1.61e+06, beyond fp16's largest value (65504)"));
  CHECK(fw->suggestions[0].python == "# in the model's forward(), where it takes logit_scale.exp():\n"
                                     "scale = self.logit_scale.clamp(max=math.log(100)).exp()\n"
                                     "# or, where the forward() is not yours to edit, after each optimizer step:\n"
                                     "with torch.no_grad():\n"
                                     "    model.logit_scale.clamp_(max=math.log(100))");
  CHECK(fw->suggestions[0].untried);
  CHECK_THAT(fw->suggestions[1].summary, Catch::StartsWith("Run the model's own code after"));
}

TEST_CASE("a parameter whose exp() stays in fp16's range, or one of many values, is not offered a bound",
          "[rules][replay]") {
  // Several values give only their largest |x|, and exp() of a large negative one is tiny.
  for (const char* parameters : {"logit_scale: 2.659 (float32, 1 value), read by Exp",
                                 "log_sigma: |x| up to 14.29 (float32, 8 values), read by Exp",
                                 "gain: 14.29 (float32, 1 value), read by Mul"}) {
    const auto r = clip_report(parameters);
    const Finding* fw = find(r, "forward-nonfinite");
    REQUIRE(fw != nullptr);
    REQUIRE_FALSE(fw->suggestions.empty());
    CHECK_THAT(fw->suggestions[0].summary, Catch::StartsWith("Run the model's own code after"));
  }
}

TEST_CASE("the model's output NaN/Inf without its operations recorded still names its code after the last module", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"body.weight", "norm.weight"});
  f.replay("", "finite");
  for (int i = 0; i < 4; ++i)
    f.activation("body", false).activation("norm", false).activation("", true).step(65536, 32768, 1000, {"norm.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->title, Catch::EndsWith("after norm, its last submodule"));
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Run the model's own code after norm, its last submodule in FP32"));
}

TEST_CASE("the model's own code is placed after the module that finishes last, not after one first called later", "[rules][replay]") {
  // A mixture of experts: experts.3, first routed to at step 2, gets a module id after norm's,
  // though norm finishes after it in every forward.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"body.weight", "norm.weight"});
  f.replay("", "finite");
  for (int i = 0; i < 6; ++i) {
    f.activation("body", false);
    if (i >= 2) f.activation("experts.3", false);
    f.activation("norm", false);
    if (i >= 3) f.activation("", true).step(65536, 32768, 1000, {"norm.weight"}, kNaN);
    else f.step(65536, 65536, 1000, {}, 1.0);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->title, Catch::EndsWith("after norm, its last submodule"));
}

TEST_CASE("a module's own code that made NaN/Inf before its first child is placed before that child", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"stem.weight", "block.conv.weight"});
  f.replay("block.conv", "nonfinite").replay("block", "finite");
  for (int i = 0; i < 4; ++i)
    f.activation("stem", false).activation("block.conv", true).activation("block", true)
        .step(65536, 32768, 1000, {"block.conv.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "block");
  CHECK_THAT(fw->title, Catch::EndsWith("in its own code, before block.conv"));
}

TEST_CASE("a replay that raised is unconfirmed and never escalates", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"transformer.h.0.attn.weight"});
  f.replay("transformer.h.0.attn", "unconfirmed", "the replay raised RuntimeError: shape mismatch");
  for (int i = 0; i < 3; ++i) f.activation("transformer.h.0.attn", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "transformer.h.0.attn");
  CHECK(fw->confirmation == "unconfirmed");
  CHECK_THAT(fw->evidence, Catch::Contains("shape mismatch"));
}

TEST_CASE("still NaN/Inf in FP32 with no enclosing replay blames the caller's code, not the module", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"bn.weight"});
  f.replay("bn", "nonfinite");
  for (int i = 0; i < 3; ++i) f.activation("bn", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module.empty());
  CHECK_THAT(fw->title, Catch::Contains("the model's own forward()"));
  CHECK_THAT(fw->evidence, Catch::Contains("bn showed it first but only received it"));
  for (const auto& s : fw->suggestions) CHECK_THAT(s.python, !Catch::Contains("pin_fp32"));
}

TEST_CASE("a module making -inf from finite inputs in FP32 too while the loss stays finite is a mask, not a failure", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"attn.qkv.weight", "head.weight"});
  f.replay("attn.mask", "intrinsic");
  for (int i = 0; i < 6; ++i) f.activation("attn.mask", true).activation("head", false).step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kInfo);
  CHECK(fw->module == "attn.mask");
  CHECK(fw->suggestions.empty());
}

TEST_CASE("a mask's -inf in a loop that records no loss is still a mask while the gradients stay finite", "[rules][replay]") {
  // An unknown loss (scale() given a non-scalar) is not a NaN one.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"attn.qkv.weight", "head.weight"});
  f.replay("attn.mask", "intrinsic");
  for (int i = 0; i < 6; ++i) f.activation("attn.mask", true).activation("head", false).no_loss().step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  CHECK(r.skipped.empty());
}

TEST_CASE("a backward overflow in a loop that records no loss is named past a mask's -inf", "[rules][replay]") {
  // The mask's -inf is by design unless the loss is known to be NaN/Inf: an unknown one is
  // not, so the skips are backward's and the first gradient in backward order is named.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"attn.qkv.weight", "head.weight"});
  f.replay("attn.mask", "intrinsic");
  double scale = 65536;
  for (int i = 0; i < 8; ++i, scale /= 2)
    f.activation("attn.mask", true).activation("head", false).no_loss().step(scale, scale / 2, 1000, {"head.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->layer == "head.weight");
  for (const auto& k : r.skipped) CHECK(k.forward == ForwardSource::kNone);
}

TEST_CASE("a module making NaN from finite inputs in FP32 too where the loss goes NaN is named, never pinned", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"norm.weight", "head.weight"});
  f.replay("norm", "intrinsic");
  for (int i = 0; i < 3; ++i) f.activation("norm", true).activation("head", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kError);
  CHECK(fw->module == "norm");
  CHECK_THAT(fw->title, Catch::Contains("even in FP32"));
  for (const auto& s : fw->suggestions) CHECK_THAT(s.python, !Catch::Contains("pin_fp32"));
}

TEST_CASE("an fp16 overflow after a mask's -inf is named, not the mask", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"attn.qkv.weight", "mlp.weight"});
  f.replay("attn.mask", "intrinsic").replay("mlp", "finite");
  for (int i = 0; i < 3; ++i) f.activation("attn.mask", true).activation("mlp", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "mlp");
  CHECK(fw->severity == Severity::kError);
  CHECK(fw->confirmation == "confirmed");
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains("pin_fp32(model.mlp)"));
  for (const auto& finding : r.findings)
    if (finding.module == "attn.mask") CHECK(finding.severity == Severity::kInfo);
  CHECK(r.skipped.front().forward_module == "mlp");
}

namespace {

// A flow's coupling layer whose exp() of an unbounded log-scale passes float32's range: its
// Inf reaches the loss. Its own sub-network, or the coupling before it, overflowing fp16 in
// other steps did not send that Inf on, so it is not "by design" (a mask's -inf the model
// absorbs), whichever of them overflowed more often.
Report intrinsic_coupling_run(const TempDir& dir, const std::string& other) {
  RunFixture f(dir.file("run.db"), {"c1.net.weight", "c2.net.weight"});
  f.replay("c2", "intrinsic").finite_replay(other, 3e5);
  for (int i = 0; i < 5; ++i) {
    const bool other_first = i >= 2;  // the other module overflows in more steps than c2 is first
    f.activation("c1.net", false).activation("c1", other_first && other == "c1");
    f.activation("c2.net", other_first && other == "c2.net").activation("c2", true).step(65536, 32768, 1000, {}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

// c2 is named for its code, as an error or a warning, nothing is "by design", and the skips'
// forward NaN/Inf are c2's.
void check_named_for_its_code(const Report& r) {
  for (const auto& finding : r.findings) CHECK_THAT(finding.title, !Catch::Contains("by design"));
  bool named = false;
  for (const auto& finding : r.findings)
    named = named || (finding.module == "c2" && finding.severity != Severity::kInfo &&
                      finding.title.find("even in FP32: its code") != std::string::npos);
  CHECK(named);
  CHECK(r.skipped.front().forward_module == "c2");
}

}  // namespace

TEST_CASE("a module inside one that makes Inf in FP32 too did not send that Inf to the loss", "[rules][replay]") {
  TempDir dir;
  check_named_for_its_code(intrinsic_coupling_run(dir, "c2.net"));
}

TEST_CASE("a module before one that makes Inf in FP32 too did not send that Inf to the loss", "[rules][replay]") {
  TempDir dir;
  check_named_for_its_code(intrinsic_coupling_run(dir, "c1"));
}

TEST_CASE("a gradient overflow in a step whose forward only held a mask's -inf is a backward overflow", "[rules][replay]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"attn.qkv.weight", "head.weight"});
  f.replay("attn.mask", "intrinsic");
  double scale = 65536;
  for (int i = 0; i < 10; ++i, scale /= 2) f.activation("attn.mask", true).step(scale, scale / 2, 1000, {"head.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->layer == "head.weight");
  CHECK(r.skipped.front().forward_module.empty());
}

namespace {

// Twenty-four skips halving from 65536 (down to 0.0078125): block.fc1 first, block.fc2 the
// finite gradient before it (its unscaled gradients 0.25, well within fp16's range), `replay`
// the agent's backward replay of block. Returns the report's overflow-origin finding.
Finding origin_after_replay(const std::string& replay) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"block.fc1.weight", "block.fc2.weight", "head.weight"});
  double scale = 65536;
  const auto skip = [&] {
    f.finite_first({"head.weight", "block.fc2.weight"}).step(scale, scale / 2, scale / 4, {"block.fc1.weight"});
    scale /= 2;
  };
  for (int i = 0; i < 17; ++i) skip();
  f.event("backward-replay", "block: " + replay);  // at step 17, once the scale is below 1
  for (int i = 0; i < 7; ++i) skip();
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  return required(r, "overflow-origin");
}

}  // namespace

TEST_CASE("a backward that is NaN at every scale but finite when replayed in FP32 is pinned, with no sqrt to look for",
          "[rules][replay]") {
  // GPT-2's tanh GELU written out: x ** 3 overflows fp16 inside the block, tanh squashes it.
  const Finding o = origin_after_replay("finite: float16 autocast: NaN/Inf in 3 of 5 gradients; FP32: 0");
  CHECK(o.module == "block");
  CHECK_THAT(o.title, Catch::EndsWith("in FP32 its backward is finite (replayed)"));
  CHECK_THAT(o.evidence, Catch::Contains("replayed at step 17") && Catch::Contains("FP32: 0"));
  REQUIRE(o.suggestions.size() == 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run block in FP32"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains("bfloat16"));
}

TEST_CASE("a backward that is NaN in FP32 too when replayed gets the look at its backward and no pin", "[rules][replay]") {
  // A distance inside the block: sqrt(0)'s gradient is NaN in any precision.
  const Finding o = origin_after_replay("intrinsic: float16 autocast: NaN/Inf in 3 of 5 gradients; FP32: 3");
  CHECK_THAT(o.title, Catch::EndsWith("its backward makes NaN/Inf in FP32 too (replayed)"));
  CHECK_THAT(o.evidence, Catch::Contains("it makes them in any precision"));
  REQUIRE(o.suggestions.size() == 1);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Look first at the backward of block"));
}

TEST_CASE("a backward replay that could not tell leaves both fixes and says why", "[rules][replay]") {
  const Finding o = origin_after_replay("unconfirmed: its inputs or output gradient held NaN/Inf");
  CHECK_THAT(o.evidence, Catch::Contains("(its backward replay could not tell: its inputs or output gradient held NaN/Inf)"));
  REQUIRE(o.suggestions.size() == 3);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Look first at the backward of block"));
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("If its true gradients are the ones beyond fp16"));
}

TEST_CASE("under a collapsed scale the module first most often below the floor is the error, not the one first more often",
          "[rules]") {
  // The head's gradients overflow at the high scales and fit below 8; the block's backward
  // goes NaN at every scale, behind the head in backward order until then.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"block.fc1.weight", "block.fc2.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 14; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight", "block.fc1.weight"});
  for (int i = 0; i < 10; ++i, scale /= 2)
    f.finite_first({"head.weight", "block.fc2.weight"}).step(scale, scale / 2, 1000, {"block.fc1.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module == "block");
  CHECK(o->severity == Severity::kError);
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK_THAT(collapse->suggestions.front().summary, Catch::StartsWith("Fix the overflow in block"));
}

TEST_CASE("under a collapsed scale a module first only while the scale calibrated above the floor is information",
          "[rules]") {
  // Two heads on a backbone: the box head's own bias overflows at the initial 65536; from
  // then on the backbone is first, down to 16. The box head's pin alone keeps the collapse.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"backbone.weight", "box.bias"});
  f.step(65536, 32768, 1000, {"box.bias", "backbone.weight"});
  double scale = 32768;
  for (int i = 0; i < 11; ++i, scale /= 2) f.finite_first({"box.bias"}).step(scale, scale / 2, 1000, {"backbone.weight"});
  for (int i = 0; i < 10; ++i) f.step(scale, scale, 1000);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  std::vector<const Finding*> origins;
  for (const auto& finding : r.findings)
    if (finding.rule == "overflow-origin") origins.push_back(&finding);
  REQUIRE(origins.size() == 2);
  CHECK(origins[0]->module == "backbone");
  CHECK(origins[0]->severity == Severity::kError);
  CHECK(origins[1]->module == "box");
  CHECK(origins[1]->severity == Severity::kInfo);
  CHECK(origins[1]->title ==
        "box went NaN/Inf first only at loss scales above the floor; backbone's overflows took the scale below it");
  CHECK_THAT(origins[1]->evidence, Catch::EndsWith("; all at a loss scale of 65536 or above, where they only "
                                                   "calibrated the scale or answered its growth probes: the skips that "
                                                   "took it below the floor of 128 were other modules'"));
  CHECK(origins[1]->suggestions.empty());
}
