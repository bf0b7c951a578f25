// The loss code (event "loss-code": the operations between the model's output and the loss,
// read from autograd's graph): the NaN/Inf findings made after the modules name the
// operation that makes NaN/Inf from finite values and its fix, and offer an FP32 loss only
// where the loss code ran in half precision (tests/scenarios/test_loss_diagnosis.py runs
// the same cases as real torch loops).
#include "rule_test.h"

namespace {

// A run whose loss is NaN at step 1 with every probed output finite, the agent having read
// `code` then (no event if empty).
Report nan_loss_run(const TempDir& dir, const std::string& code) {
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).step(65536, 65536);
  if (!code.empty()) f.event("loss-code", code);
  f.activation("enc", false).step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.activation("enc", false).step(32768, 32768);
  f.finish();
  return report_of(dir.file("run.db"));
}

// A run whose gradient reaching the model's output held NaN at every scale, the loss finite,
// the agent having read `code` in each step, and traced `origin` (event loss-code-origin)
// where given.
Report nan_loss_gradient_run(const TempDir& dir, const std::string& code, const std::string& origin = "") {
  RunFixture f(dir.file("run.db"), kLayers);
  if (!origin.empty()) f.event("loss-code-origin", origin);
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2)
    f.event("output-gradient-nonfinite", "float32 [16, 32]: 512 NaN, 0 Inf of 512 values")
        .event("loss-code", code)
        .activation("enc", false)
        .step(scale, scale / 2, 1000, {"head.weight", "b.weight"});
  f.finish();
  return report_of(dir.file("run.db"));
}

// A run whose gradient reaching the model's output held NaN in its first `overflows` steps,
// each halving the scale from 65536, with `code` read in each, then `clean` steps at the
// scale it came down to.
Report output_gradient_at_the_start(const TempDir& dir, const std::string& code, int overflows, int clean) {
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < overflows; ++i, scale /= 2)
    f.event("output-gradient-nonfinite", "float16 [16, 32]: 512 NaN, 0 Inf of 512 values")
        .event("loss-code", code)
        .activation("enc", false)
        .step(scale, scale / 2, 1000, {"head.weight", "b.weight"});
  for (int i = 0; i < clean; ++i) f.activation("enc", false).step(scale, scale);
  f.finish();
  return report_of(dir.file("run.db"));
}

// SimCLR's NT-Xent under autocast: float16 similarities divided by the temperature.
const std::string kContrastive = "Cat:float16, Mm:float16, Div:float16, ToCopy:float32, LogSoftmax:float32, NllLoss(mean):float32";

// Whether a suggestion's Python holds `code`.
bool offers(const Finding& f, const std::string& code) {
  for (const auto& s : f.suggestions)
    if (s.python.find(code) != std::string::npos) return true;
  return false;
}

bool offers_fp32_loss(const Finding& f) { return offers(f, ".float()"); }

// The fix of `f` whose summary starts with `start`; nullptr where none does.
const Suggestion* fix_starting(const Finding& f, const std::string& start) {
  for (const auto& s : f.suggestions)
    if (s.summary.rfind(start, 0) == 0) return &s;
  return nullptr;
}

// The forward-nonfinite finding of a run whose loss went NaN at step 1, the agent having read
// the loss code `code` and the tensor it was given `given` (event loss-input-nonfinite) then.
Finding given_nonfinite_finding(const std::string& code, const std::string& given) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).step(65536, 65536);
  f.event("loss-code", code).event("loss-input-nonfinite", given).activation("enc", false).step(
      65536, 32768, 1000, {"head.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  return *fw;
}

// The forward-nonfinite finding of nan_loss_run(code).
Finding nan_loss_finding(const std::string& code) {
  TempDir dir;
  const Report r = nan_loss_run(dir, code);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  return *fw;
}

// The ignore_index fix itself (the generic look mentions ignore_index as an example).
bool offers_ignore_index(const Finding& f) { return offers(f, "ignore_index="); }

}  // namespace

TEST_CASE("an Inf loss from CTCLoss in a float32 loss code gets zero_infinity and no FP32 loss", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "ToCopy:float32, LogSoftmax:float32, Transpose:float32, CtcLoss:float32, "
                                     "Div:float32, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence,
             Catch::Contains("(step 1): ToCopy, LogSoftmax, Transpose, CtcLoss, Div, Mean (all float32)"));
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains("zero_infinity=True"));
  CHECK_THAT(fw->suggestions.at(1).summary, Catch::StartsWith("Else, as Div can make NaN/Inf too, look at"));
  CHECK_THAT(fw->suggestions.at(1).summary, Catch::Contains("computing it in FP32 will not help"));
  CHECK_FALSE(offers_fp32_loss(*fw));
}

TEST_CASE("the CTC fix says where a Hugging Face *ForCTC model, which computes the loss itself, takes zero_infinity",
          "[rules][loss-code]") {
  // Wav2Vec2ForCTC passes config.ctc_zero_infinity to ctc_loss: there is no nn.CTCLoss to change.
  TempDir dir;
  const Report r = nan_loss_run(dir, "LogSoftmax:float32, CtcLoss:float32, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->suggestions.front().summary, Catch::Contains("(in a Hugging Face *ForCTC model, which computes the "
                                                              "loss itself: config.ctc_zero_infinity=True)"));
  CHECK_THAT(fw->suggestions.front().python, Catch::EndsWith("\nmodel.config.ctc_zero_infinity = True"));
}

TEST_CASE("a known operation that ran in float16 gets the FP32 loss first, then its own fix", "[rules][loss-code]") {
  // A softmax's probability below fp16's smallest value is 0 before the log: FP32 may be all it takes.
  TempDir dir;
  const Report r = nan_loss_run(dir, "Softmax:float16, Log:float16, Neg:float16, Mean:float16");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("Softmax, Log, Neg, Mean (all float16)"));
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Softmax, Log, Neg and Mean ran in float16"));
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains(".float()"));
  CHECK_THAT(fw->suggestions.at(1).python, Catch::Contains("clamp_min(1e-12).log()"));
}

TEST_CASE("a clamp the fix gives an operation that ran in float16 is taken in float32, where 1e-12 is not 0",
          "[rules][loss-code]") {
  // p.clamp_min(1e-12) of a float16 p clamps at 0: log(0) is still -Inf.
  TempDir dir;
  const Report r = nan_loss_run(dir, "Sigmoid:float16, Log:float16, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  const Suggestion* clamp = fix_starting(*fw, "log() of 0");
  REQUIRE(clamp != nullptr);
  CHECK_THAT(clamp->summary, Catch::Contains("It ran in float16, where 1e-12 rounds to 0: clamp in float32, in the "
                                             "loss computed in FP32"));
  CHECK_THAT(clamp->python, Catch::StartsWith("logp = p.float().clamp_min(1e-12).log()"));
  CHECK_THAT(clamp->cpp, Catch::StartsWith("auto logp = p.to(torch::kFloat).clamp_min(1e-12).log();"));
}

TEST_CASE("a clamp the fix gives an operation that ran in float32 or bfloat16 is left as it is", "[rules][loss-code]") {
  for (const std::string dtype : {"float32", "bfloat16"}) {
    TempDir dir;
    const Report r = nan_loss_run(dir, "ToCopy:float32, Log:" + dtype + ", Mean:float32");
    const Finding* fw = find(r, "forward-nonfinite");
    REQUIRE(fw != nullptr);
    const Suggestion* clamp = fix_starting(*fw, "log() of 0");
    REQUIRE(clamp != nullptr);
    CHECK_THAT(clamp->python, Catch::StartsWith("logp = p.clamp_min(1e-12).log()"));
    CHECK_THAT(clamp->summary, !Catch::Contains("rounds"));
  }
}

TEST_CASE("an acos clamped inside [-1, 1] in bfloat16 is taken in float32, where 1 - 1e-7 is not 1",
          "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Mul:bfloat16, Sum:bfloat16, Acos:bfloat16, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  const Suggestion* clamp = fix_starting(*fw, "acos()");
  REQUIRE(clamp != nullptr);
  CHECK_THAT(clamp->python, Catch::Contains("cos.float().clamp(-1 + 1e-7, 1 - 1e-7)"));
  CHECK_THAT(clamp->summary, Catch::Contains("where 1 - 1e-7 rounds to 1: clamp in float32"));
}

TEST_CASE("a contrastive loss's float16 matmul is named with the division by its temperature", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Permute:float16, Mm:float16, Div:float16, ToCopy:float32, LogSoftmax:float32, "
                                     "NllLoss:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Mm and Div ran in float16"));
}

TEST_CASE("a float16 division by a constant temperature gets the FP32 loss with its gain and no clamp of a denominator",
          "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Permute:float16, Mm:float16, Div(0.07):float16, ToCopy:float32, LogSoftmax:float32, "
                                     "NllLoss(mean of 64):float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("Mm (float16), Div (float16), ToCopy (float32)"));
  CHECK_THAT(fw->suggestions.front().summary,
             Catch::StartsWith("Mm and Div ran in float16, whose range ends at 65504, and the division by 0.07 (Div) "
                               "multiplies what it divides by 14.29, so every value above 4585 passes fp16's 65504. "
                               "Compute the loss in FP32"));
  for (const Suggestion& s : fw->suggestions) CHECK_THAT(s.python, !Catch::Contains("clamp_min"));
}

TEST_CASE("a float32 division by a constant is no division by 0", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "ToCopy:float32, Div(0.5):float32, Sqrt:float32, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("sqrt() of a negative number"));
  CHECK_THAT(fw->suggestions.at(1).summary, Catch::StartsWith("Else, look at"));  // no "as Div can make NaN/Inf too"
}

TEST_CASE("a known operation that ran in float32 after a float16 one gets its own fix first", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Sum:float16, ToCopy:float32, Log:float32, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains("clamp_min(1e-12).log()"));
  CHECK(offers_fp32_loss(*fw));  // the float16 sum before it may still overflow
}

TEST_CASE("a log-cosh loss in float32 names cosh's overflow with its stable form, not log()'s argument",
          "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Sub:float32, Cosh:float32, Log:float32, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  REQUIRE_FALSE(fw->suggestions.empty());
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("cosh() / sinh() overflow above 89.4 in float32"));
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains("d.abs() + F.softplus(-2 * d.abs()) - math.log(2)"));
  for (const auto& s : fw->suggestions) {
    CHECK_THAT(s.summary, !Catch::Contains("log() of 0"));
    CHECK_THAT(s.summary, !Catch::Contains("as Log can make NaN/Inf too"));
  }
  CHECK_FALSE(offers_fp32_loss(*fw));
}

TEST_CASE("a log after a sum of exponentials is still named beside exp()", "[rules][loss-code]") {
  // x.exp().sum().log(): the sum of exp() may be 0 where every exp() underflows.
  TempDir dir;
  const Report r = nan_loss_run(dir, "Exp:float32, Sum:float32, Log:float32, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  REQUIRE(fw->suggestions.size() >= 2);
  CHECK_THAT(fw->suggestions[0].summary, Catch::StartsWith("exp() overflows above 88.7"));
  CHECK_THAT(fw->suggestions[1].summary, Catch::StartsWith("Else, as Log can make NaN/Inf too"));
}

TEST_CASE("a loss code with no operation known to make NaN/Inf keeps the generic look and the FP32 loss", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Sum:float16, Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("Sum (float16), Mean (float32)"));
  REQUIRE(fw->suggestions.size() == 1);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Look at the code after the model's last module"));
  CHECK(offers_fp32_loss(*fw));
}

TEST_CASE("without a loss-code event the NaN loss finding is as before: look, and compute the loss in FP32", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, !Catch::Contains("the operations from the model's output"));
  CHECK(offers_fp32_loss(*fw));
}

TEST_CASE("a loss code read in a step whose loss was not made after the modules is not used", "[rules][loss-code]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("loss-code", "CtcLoss:float32, Mean:float32").activation("enc", true).step(65536, 32768, 1000, {"a.weight"}, kNaN);
  f.activation("enc", false).step(32768, 16384, 1000, {"head.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  bool loss_finding = false;
  for (const auto& fw : r.findings)
    if (fw.rule == "forward-nonfinite" && fw.module.empty()) {
      loss_finding = true;
      CHECK_THAT(fw.evidence, !Catch::Contains("CtcLoss"));
    }
  CHECK(loss_finding);
}

TEST_CASE("scale-collapse points to the loss code when the loss is made after the modules", "[rules][loss-code]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.event("loss-code", "CtcLoss:float32").activation("enc", false).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK(collapse->suggestions.front().summary ==
        "Fix the NaN/Inf made in the loss code after the model's last module (see forward-nonfinite); the scale "
        "recovers once it is gone.");
}

TEST_CASE("the gradient of sqrt at 0 is named in the loss's backward, past a harmless power of 2", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_gradient_run(dir, "Sub:float32, Pow(2):float32, Sum:float32, Sqrt:float32, Mean:float32");
  const Finding* lb = find(r, "loss-backward");
  REQUIRE(lb != nullptr);
  CHECK_THAT(lb->evidence, Catch::Contains("Sub, Pow(2), Sum, Sqrt, Mean (all float32)"));
  CHECK_THAT(lb->suggestions.front().summary, Catch::StartsWith("sqrt()'s gradient at 0 is infinite"));
  CHECK_THAT(lb->suggestions.at(1).summary, Catch::StartsWith("Else, look at the code between"));
}

// MAML's meta step: its first two steps' gradient reaching the model's output held NaN, the
// loss code float32 (an MSE), then 20 clean steps at the scale they came down to; `second_order`
// adds the agent's event that the loop differentiated gradients it took itself.
Report meta_learning_run(const TempDir& dir, bool second_order) {
  RunFixture f(dir.file("run.db"), kLayers);
  if (second_order)
    f.event("gradients-differentiated", "torch.autograd.grad with create_graph=True on a loss scaler.scale() did not "
                                        "make: a backward through those gradients also differentiates the model's backward");
  double scale = 65536;
  for (int i = 0; i < 2; ++i, scale /= 2)
    f.event("output-gradient-nonfinite", "float16 [10, 1]: 8 NaN, 2 Inf of 10 values")
        .event("loss-code", "ToCopy:float32, MseLoss(mean):float32, Div:float32, Add:float32")
        .activation("enc", false)
        .step(scale, scale / 2, 1000, {"head.weight", "b.weight"});
  for (int i = 0; i < 20; ++i) f.activation("enc", false).step(scale, scale);
  f.finish();
  return report_of(dir.file("run.db"));
}

TEST_CASE("NaN reaching the model's output in a second-order loop is not put on the loss code's backward",
          "[rules][loss-code]") {
  // MAML's meta backward runs the modules' backward in reverse (the inner step's
  // create_graph=True), which overflows fp16 at 65536 and reaches the inner call's output:
  // the scaler's calibration, which had been an error naming the loss's backward.
  TempDir dir;
  const Report r = meta_learning_run(dir, true);
  CHECK(find(r, "loss-backward") == nullptr);
  CHECK(r.healthy());
  CHECK(required(r, "overflow-origin").severity == Severity::kInfo);
}

TEST_CASE("NaN reaching the model's output in a first-order loop is still the loss code's backward", "[rules][loss-code]") {
  TempDir dir;
  const Report r = meta_learning_run(dir, false);
  CHECK(required(r, "loss-backward").severity == Severity::kError);
}

// A batch-hard triplet loss on normalised embeddings: F.normalize's division, then sqrt() of
// each embedding's squared distance to itself, 0.
const std::string kTripletCode = "LinalgVectorNorm:float16, ClampMin:float16, Expand:float16, Div:float16, "
                                 "Unsqueeze:float16, Sub:float16, Pow(2):float16, Sum:float16, Sqrt:float16, "
                                 "Add:float32, Min:float32, Relu:float32, Mean:float32";

TEST_CASE("the operation traced as the loss backward's origin leads, not the first known one", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_gradient_run(dir, kTripletCode,
                                         "LinalgVectorNorm:float16, ClampMin:float16, Expand:float16, Div:float16, "
                                         "Unsqueeze:float16, Sub:float16, Pow(2):float16, Sum:float16, Sqrt:float16");
  const Finding& lb = required(r, "loss-backward");
  CHECK_THAT(lb.evidence, Catch::Contains("; at step 0 Sqrt (float16) was the first of it whose backward sent NaN/Inf "
                                          "back from finite gradients, after LinalgVectorNorm, ClampMin"));
  REQUIRE(lb.suggestions.size() >= 2);
  CHECK_THAT(lb.suggestions.front().summary, Catch::StartsWith("sqrt()'s gradient at 0 is infinite"));
  CHECK_THAT(lb.suggestions.at(1).summary, Catch::StartsWith("To clamp in float32: Compute the loss in FP32"));
  for (const auto& s : lb.suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("a / b's gradient"));
}

TEST_CASE("without a traced origin the loss backward's first known operation leads", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_gradient_run(dir, kTripletCode);
  CHECK_THAT(required(r, "loss-backward").suggestions.front().summary, Catch::StartsWith("a / b's gradient at b = 0"));
}

TEST_CASE("a traced origin with no known fix is named in the look", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_gradient_run(dir, kTripletCode, "LinalgVectorNorm:float16, Expand:float16, Mul:float16");
  const Finding& lb = required(r, "loss-backward");
  CHECK_THAT(lb.suggestions.front().summary, Catch::StartsWith("Mul (float16)'s backward made them from finite "
                                                               "gradients. Look at the code between"));
}

TEST_CASE("a power below 1 is named in the loss's backward", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_gradient_run(dir, "Sub:float32, Pow(0.5):float32, Mean:float32");
  const Finding* lb = find(r, "loss-backward");
  REQUIRE(lb != nullptr);
  CHECK_THAT(lb->suggestions.front().summary, Catch::StartsWith("x ** p with p below 1"));
}

TEST_CASE("a loss code with unreadable items still names what it can", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Odd, :float32, Log:, , Mean:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("Odd (?), :float32 (?), Log (?), Mean (float32)"));
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains("clamp_min(1e-12).log()"));
  CHECK(offers_fp32_loss(*fw));  // dtypes unknown: FP32 is not ruled out
}

TEST_CASE("a loss whose target held NaN before backward is the data's, with the masking fix alone", "[rules][loss-code]") {
  const Finding f = given_nonfinite_finding("ToCopy:float32, MseLoss:float32", "MseLoss target: 1 NaN, 0 Inf of 32 values");
  CHECK(f.title == "The loss is NaN/Inf because MseLoss's target already held NaN/Inf: not the model or the loss code");
  CHECK_THAT(f.evidence, Catch::EndsWith("held NaN/Inf in 1 of the 1 step whose loss code was read (step 1: 1 NaN, 0 "
                                          "Inf of 32 values)"));
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions.front().python, Catch::Contains("keep = torch.isfinite(y)"));
}

TEST_CASE("a float16 tensor the loss was given that held NaN is not cleared of fp16: its FP32 fix leads",
          "[rules][loss-code]") {
  // PPO's advantages normalised under autocast: (x - mean) / (std + 1e-8) with 1e-8 = 0 in fp16.
  const Finding f = given_nonfinite_finding(
      "LogSoftmax:float16, Gather:float16, Sub:float32, Exp:float32, Mul:float32, Mean:float32",
      "Mul other: 64 NaN, 0 Inf of 64 values, float16");
  CHECK(f.title == "The loss is NaN/Inf because Mul's other already held NaN/Inf, a float16 tensor made outside the "
                   "model: not the model or the loss code");
  CHECK_THAT(f.evidence, Catch::EndsWith("(step 1: 64 NaN, 0 Inf of 64 values, float16)"));
  REQUIRE(f.suggestions.size() == 2);
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("Mul's other was float16: where the loop computes it under "
                                                         "autocast, compute it in FP32"));
  CHECK_THAT(f.suggestions[1].summary, Catch::StartsWith("Find where Mul's other gets NaN/Inf") &&
                                           !Catch::Contains("computing the loss in FP32"));
}

TEST_CASE("a float16 tensor the loss was given that held NaN names fp16's epsilon, sums and exp()", "[rules][loss-code]") {
  // SwAV's Sinkhorn codes, exp(scores / 0.05) under no_grad from float16 scores.
  const Finding f = given_nonfinite_finding("Div:float16, LogSoftmax:float16, Mul:float16, Sum:float16, Mean:float16",
                                            "Mul self: 3200 NaN, 0 Inf of 3200 values, float16");
  REQUIRE_FALSE(f.suggestions.empty());
  CHECK_THAT(f.suggestions[0].summary, Catch::Contains("In float16 an epsilon such as 1e-8 is 0") &&
                                           Catch::Contains("exp() of anything above 11.09"));
}

TEST_CASE("a bfloat16 tensor the loss was given that held NaN is told FP32 without fp16's reasons", "[rules][loss-code]") {
  const Finding f = given_nonfinite_finding("Div:bfloat16, LogSoftmax:bfloat16, Mul:bfloat16, Mean:bfloat16",
                                            "Mul self: 64 NaN, 0 Inf of 64 values, bfloat16");
  REQUIRE_FALSE(f.suggestions.empty());
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("Mul's self was bfloat16: where the loop computes it under "
                                                         "autocast, compute it in FP32") &&
                                           !Catch::Contains("1e-8 is 0") && !Catch::Contains("65504"));
}

TEST_CASE("a target held NaN in some of the steps looked at: its fix leads and the loss code's stay", "[rules][loss-code]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("loss-code", "ToCopy:float32, Log:float32, Mean:float32")
      .activation("enc", false)
      .step(65536, 32768, 1000, {"head.weight"}, kNaN);
  f.event("loss-code", "ToCopy:float32, Log:float32, Mean:float32")
      .event("loss-input-nonfinite", "Mul other: 2 NaN, 0 Inf of 8 values")
      .activation("enc", false)
      .step(32768, 16384, 1000, {"head.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->title, Catch::StartsWith("The loss is NaN/Inf while every probed module's output is finite"));
  CHECK_THAT(fw->evidence, Catch::Contains("the other given to Mul held NaN/Inf in 1 of the 2 steps"));
  REQUIRE(fw->suggestions.size() > 1);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("Find where Mul's other gets NaN/Inf"));
  CHECK_THAT(fw->suggestions.at(1).python, Catch::Contains("clamp_min(1e-12).log()"));
}

TEST_CASE("a masked mean divided by a count of 0 gets the division's fix, not ignore_index", "[rules][loss-code]") {
  // cross_entropy(reduction='none') cannot be 0/0: the user's own sum / count is.
  TempDir dir;
  const Report r = nan_loss_run(dir, "ToCopy:float32, LogSoftmax:float32, NllLoss(none):float32, Mul:float32, "
                                     "Sum:float32, Div:float32");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::Contains("LogSoftmax, NllLoss(none), Mul, Sum, Div (all float32)"));
  CHECK_THAT(fw->suggestions.front().python, Catch::Contains("den.clamp_min(1e-12)"));
  CHECK_FALSE(offers_ignore_index(*fw));
}

TEST_CASE("a mean nll_loss over kept targets is not offered the ignore_index fix", "[rules][loss-code]") {
  TempDir dir;
  const Report r = nan_loss_run(dir, "Softmax:float16, Log:float16, NllLoss(mean of 12):float16");
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_FALSE(offers_ignore_index(*fw));
}

TEST_CASE("a mean nll_loss over no kept target, or one whose weight was not read, is offered ignore_index",
          "[rules][loss-code]") {
  for (const std::string nll : {"NllLoss(mean of 0)", "NllLoss(mean)", "NllLoss", "NllLoss2D(mean of 0)"}) {
    TempDir dir;
    const Report r = nan_loss_run(dir, "ToCopy:float32, LogSoftmax:float32, " + nll + ":float32");
    const Finding* fw = find(r, "forward-nonfinite");
    REQUIRE(fw != nullptr);
    INFO(nll);
    CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("nll_loss / cross_entropy with reduction='mean'"));
  }
}

TEST_CASE("a float16 view of the model's output before .float() does not make the loss code half precision",
          "[rules][loss-code]") {
  // F.cross_entropy(logits.reshape(-1, C).float(), y, ignore_index=-100) on a batch whose
  // every label is ignored: the loss computes in float32, so an FP32 loss cannot help.
  const Finding fw = nan_loss_finding("View:float16, ToCopy:float32, LogSoftmax:float32, NllLoss(mean of 0):float32");
  CHECK(offers_ignore_index(fw));
  CHECK_FALSE(offers_fp32_loss(fw));
  CHECK_THAT(fw.suggestions.back().summary, Catch::Contains("computing it in FP32 will not help"));
}

TEST_CASE("a cast of the model's output down to float16 keeps the FP32 loss on offer", "[rules][loss-code]") {
  CHECK(offers_fp32_loss(nan_loss_finding("ToCopy:float16, LogSoftmax:float32, NllLoss:float32")));
}

TEST_CASE("NaN reaching the output only at the first scales of a float16 loss code is the scaler's overflow",
          "[rules][loss-code]") {
  // A temperature of 0.01 multiplies the scaled gradient by 100 in the loss's fp16 backward:
  // it overflows at 65536 to 16384, and never in the 40 steps at 8192.
  TempDir dir;
  const Report r = output_gradient_at_the_start(dir, kContrastive, 3, 40);
  CHECK(find(r, "loss-backward") == nullptr);
  CHECK(r.healthy());
}

namespace {

// Whether loss-backward is an error in output_gradient_at_the_start's run of 3 overflows.
bool loss_backward_error(const std::string& code, int clean) {
  TempDir dir;
  const Report r = output_gradient_at_the_start(dir, code, 3, clean);
  const Finding* f = find(r, "loss-backward");
  return f != nullptr && f->severity == Severity::kError;
}

}  // namespace

TEST_CASE("the same NaN in a float32 loss code is its backward's at any scale", "[rules][loss-code]") {
  // No float16 operation to overflow: the scale falling below it does not explain it going.
  CHECK(loss_backward_error("Sub:float32, Sqrt:float32, Mean:float32", 40));
}

TEST_CASE("NaN reaching the output only at the first scales of a float32 loss code on the cast-up output is the "
          "scaler's overflow",
          "[rules][loss-code]") {
  // A multi-resolution STFT loss on a float16 waveform: the cast up's backward casts the scaled
  // gradient, 1 / |X| of a log-magnitude, back down to float16, Inf at 65536 to 16384, and the
  // three resolutions' Infs of both signs add up to NaN there; none in 40 steps at 8192.
  TempDir dir;
  const Report r = output_gradient_at_the_start(
      dir, "Select:float16, View:float16, ToCopy:float32, FftR2C:complex64, Abs:float32, Log:float32, Mean:float32", 3, 40);
  CHECK(find(r, "loss-backward") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("the same NaN on the cast-up output with too few steps below to tell stays the loss's backward",
          "[rules][loss-code]") {
  CHECK(loss_backward_error("Select:float16, View:float16, ToCopy:float32, Sub:float32, Sqrt:float32, Mean:float32", 2));
}

TEST_CASE("too few steps below the scale a float16 loss code's NaN stopped at to tell keep it the loss's backward",
          "[rules][loss-code]") {
  CHECK(loss_backward_error(kContrastive, 2));
}

TEST_CASE("a float32 tensor the loss was given holding only float16 values is taken as made in float16",
          "[rules][loss-code]") {
  // A style loss's Gram matrix of a frozen network's features, overflowed in float16's Bmm,
  // then cast to float32 by autocast for MseLoss.
  const Finding f = given_nonfinite_finding("Bmm:float16, Div:float16, ToCopy:float32, MseLoss:float32",
                                            "MseLoss target: 0 NaN, 1544 Inf of 16384 values, float32 (float16 values)");
  // The loss code's own Bmm runs in fp16 too: the model is cleared, the loss code is not.
  CHECK(f.title == "The loss is NaN/Inf because MseLoss's target already held NaN/Inf, a tensor made in float16 outside "
                   "the model: not the model");
  CHECK_THAT(f.evidence, Catch::EndsWith("(step 1: 0 NaN, 1544 Inf of 16384 values, float32, every finite value a "
                                         "float16 one: made in float16, then cast up)"));
  REQUIRE(f.suggestions.size() == 3);
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("MseLoss's target was made in float16: where the loop "
                                                         "computes it under autocast, compute it in FP32"));
}

namespace {

// A run whose float16 gradient reaching the model's output held Inf and no NaN (event
// "output-gradient-overflow") in its first `overflows` steps, each halving the scale from
// 65536, with `code` read in each, then 10 steps at the scale it came down to.
Report output_overflow_run(const TempDir& dir, const std::string& code, int overflows) {
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < overflows; ++i, scale /= 2)
    f.event("output-gradient-overflow", "float16 [16, 32]: 0 NaN, 40 Inf of 512 values")
        .event("loss-code", code)
        .activation("enc", false)
        .step(scale, scale / 2, 1000, {"head.weight", "b.weight"});
  for (int i = 0; i < 10; ++i) f.activation("enc", false).step(scale, scale);
  f.finish();
  return report_of(dir.file("run.db"));
}

// A focal loss written on an fp16 sigmoid: log's backward, 1/p of a p near 0, overflows.
const std::string kFocal = "Sigmoid:float16, Rsub:float16, Log:float16, Pow(2):float16, Mul:float32, Mean:float32";

}  // namespace

TEST_CASE("an fp16 loss code whose backward overflows into the output down to a low scale is named, with the FP32 loss "
          "first",
          "[rules][loss-code]") {
  TempDir dir;
  const Report r = output_overflow_run(dir, kFocal, 12);  // down to 32
  const Finding& lb = required(r, "loss-backward");
  CHECK(lb.severity == Severity::kError);
  CHECK_THAT(lb.evidence, Catch::Contains("(float16 [16, 32]: 0 NaN, 40 Inf of 512 values)"));
  CHECK_THAT(lb.suggestions.front().summary,
             Catch::StartsWith("Sigmoid, Rsub, Log and Pow(2) ran in float16, and in 12 steps the float16 gradient "
                               "they sent into the model's output held Inf at loss scales down to 32"));
  CHECK(offers_fp32_loss(lb));
  for (const auto& s : lb.suggestions)  // the last module's pin makes the loss code's inputs float32
    CHECK_THAT(s.summary, !Catch::Contains("pinning the model's modules to FP32 cannot help"));
  CHECK(find(r, "overflow-origin") == nullptr);
}

TEST_CASE("an fp16 loss code whose backward overflows into the output only at high scales is the scale's",
          "[rules][loss-code]") {
  // The scaled gradient overflowing where it enters the output: the scaler answers it, and
  // the first layer it reached is named as before.
  TempDir dir;
  const Report r = output_overflow_run(dir, kFocal, 4);  // down to 8192
  CHECK(find(r, "loss-backward") == nullptr);
  CHECK(find(r, "overflow-origin") != nullptr);
}

TEST_CASE("a float32 loss code whose gradient overflows float16 at the output is the cast's, at any scale",
          "[rules][loss-code]") {
  // `.float()` before the loss: its backward casts the scaled gradient down to float16.
  TempDir dir;
  const Report r = output_overflow_run(dir, "ToCopy:float32, MseLoss:float32", 12);
  CHECK(find(r, "loss-backward") == nullptr);
  CHECK(find(r, "overflow-origin") != nullptr);
}
