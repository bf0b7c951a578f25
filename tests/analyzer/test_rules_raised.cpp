// The training raised inside the Python agent's with-block (event "training-raised", at the
// step that never ended): the report says so instead of "healthy", and where the raise was
// clip_grad_norm_(error_if_nonfinite=True) refusing gradients a GradScaler skips, that is
// the error it names (tests/scenarios/test_clip_raised.py runs the real loop).
#include "rule_test.h"

namespace {

const char* kClipRefused =
    "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`";

// Three quiet steps at scale 1024, then `raised` at the fourth, which never ended.
void raised_at_step_3(const std::string& path, const std::string& raised, bool scaler = true) {
  RunFixture f(path, kLayers);
  if (!scaler) f.meta("scaler_enabled", "0");
  for (int i = 0; i < 3; ++i) f.step(scaler ? 1024 : 1, scaler ? 1024 : 1);
  f.event("training-raised", raised);
  f.finish();
}

// `raised` before the first step ended: the run.db holds no step.
void raised_before_step_0(const std::string& path, const std::string& raised) {
  RunFixture f(path, kLayers);
  f.event("training-raised", raised);
  f.finish();
}

Report report_raised_at_step_3(const std::string& raised, bool scaler = true) {
  TempDir dir;
  raised_at_step_3(dir.file("run.db"), raised, scaler);
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("clip_grad_norm_ refusing NaN/Inf gradients under a scaler is an error that says to leave "
          "error_if_nonfinite off",
          "[rules][raised]") {
  const Report r = report_raised_at_step_3(kClipRefused);
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kError);
  CHECK(Gate("error").fails(r));
  CHECK(r.findings.front().rule == "training-raised");
  CHECK_THAT(f.title, Catch::StartsWith("The training stopped at step 3: clip_grad_norm_(error_if_nonfinite=True)"));
  CHECK_THAT(f.evidence, Catch::Contains("the run.db holds the 3 steps before it; the loss scale was 1024"));
  CHECK_THAT(f.suggestions.front().summary, Catch::Contains("leave clip_grad_norm_'s error_if_nonfinite at False"));
  CHECK_THAT(f.suggestions.front().python, Catch::Contains("scaler.unscale_(optimizer)\n"
                                                            "torch.nn.utils.clip_grad_norm_(model.parameters(), "
                                                            "max_norm)  # no error_if_nonfinite=True"));
}

TEST_CASE("the same refusal without a scaler is a warning: the step whose gradients held NaN/Inf was never recorded",
          "[rules][raised]") {
  const Report r = report_raised_at_step_3(kClipRefused, false);
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kWarning);
  CHECK_FALSE(Gate("error").fails(r));
  CHECK_THAT(f.suggestions.front().summary, Catch::Contains("run past it once without error_if_nonfinite=True"));
}

TEST_CASE("any other exception is a warning that the report covers the steps before it", "[rules][raised]") {
  const Report r = report_raised_at_step_3("KeyError: 'pixel_values'");
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kWarning);
  CHECK(f.title == "The training raised KeyError at step 3 and stopped: this report covers the steps before it");
  CHECK(f.suggestions.empty());
  CHECK_FALSE(Gate("error").fails(r));
}

const char* kAnomaly = "RuntimeError: Function 'AddmmBackward0' returned nan values in its 0th output.";

TEST_CASE("anomaly detection raising on a NaN under a scaler is an error that says to turn it off", "[rules][raised]") {
  const Report r = report_raised_at_step_3(kAnomaly);
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kError);
  CHECK(r.findings.front().rule == "training-raised");
  CHECK(f.title == "The training stopped at step 3: anomaly detection raised on a NaN in the backward (in "
                   "AddmmBackward0) that scaler.step() would have skipped");
  CHECK_THAT(f.evidence, Catch::EndsWith("; the loss scale was 1024"));
  CHECK_THAT(f.suggestions.front().summary, Catch::StartsWith("Turn anomaly detection off"));
  CHECK_THAT(f.suggestions.front().python, Catch::StartsWith("torch.autograd.set_detect_anomaly(False)"));
  CHECK_THAT(f.suggestions.front().cpp, Catch::StartsWith("torch::autograd::AnomalyMode::set_enabled(false);"));
}

TEST_CASE("anomaly detection raising without a scaler is a warning that says to run once without it",
          "[rules][raised]") {
  const Report r = report_raised_at_step_3(kAnomaly, false);
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kWarning);
  CHECK(f.title == "The training stopped at step 3: anomaly detection raised on a NaN the backward made (in "
                   "AddmmBackward0)");
  CHECK_THAT(f.suggestions.front().summary, Catch::StartsWith("Run once without anomaly detection"));
}

TEST_CASE("a run that anomaly detection stopped before its first step under a scaler says what to do in its error",
          "[rules][raised]") {
  TempDir dir;
  raised_before_step_0(dir.file("run.db"), kAnomaly);
  CHECK_THROWS_WITH(load_run(dir.file("run.db")),
                    Catch::Contains("returned nan values in its 0th output. Turn anomaly detection off"));
}

TEST_CASE("a training stopped with Ctrl-C is no finding", "[rules][raised]") {
  const Report r = report_raised_at_step_3("KeyboardInterrupt");
  CHECK(find(r, "training-raised") == nullptr);
}

TEST_CASE("a run that clip_grad_norm_ stopped before its first step under a scaler says what to do in its error",
          "[rules][raised]") {
  TempDir dir;
  raised_before_step_0(dir.file("run.db"), kClipRefused);
  CHECK_THROWS_WITH(load_run(dir.file("run.db")),
                    Catch::Contains("holds no steps: before its first step was recorded, the training raised "
                                    "RuntimeError: The total norm") &&
                        Catch::EndsWith("leave clip_grad_norm_'s error_if_nonfinite at False (its default): a step "
                                        "whose gradients hold NaN/Inf is the scaler's to skip (scaler.step() does, "
                                        "and lowers the scale), and its first steps overflow by design while it comes "
                                        "down from init_scale."));
}

TEST_CASE("a GradScaler refusing complex gradients before the first step says to keep them as real tensors",
          "[rules][raised]") {
  // A Fourier neural operator's cfloat spectral weights under torch.amp.GradScaler("cpu").
  TempDir dir;
  raised_before_step_0(dir.file("run.db"), "NotImplementedError: \"_amp_foreach_non_finite_check_and_unscale_cpu\" not "
                                           "implemented for 'ComplexFloat'");
  CHECK_THROWS_WITH(load_run(dir.file("run.db")),
                    Catch::Contains("not implemented for 'ComplexFloat'. GradScaler cannot unscale complex gradients") &&
                        Catch::Contains("nn.Parameter(torch.view_as_real(w))"));
}

TEST_CASE("a GradScaler refusing a .half() model's gradients before the first step says to keep FP32 master weights",
          "[rules][raised]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("training-raised", "ValueError: Attempting to unscale FP16 gradients.");
  f.finish();
  CHECK_THROWS_WITH(load_run(dir.file("run.db")),
                    Catch::Contains("the training raised ValueError: Attempting to unscale FP16 gradients. A GradScaler "
                                    "unscales FP32 gradients only: keep the parameters in float32 (no model.half())"));
}

TEST_CASE("the same refusal after recorded steps is a warning whose fix keeps FP32 master weights", "[rules][raised]") {
  const Report r = report_raised_at_step_3("ValueError: Attempting to unscale FP16 gradients.");
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kWarning);
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions.front().summary, Catch::StartsWith("Keep FP32 master weights"));
}

TEST_CASE("each GradScaler call-order refusal torch raises gets the order that fixes it", "[rules][raised]") {
  const auto [raised, fix] = GENERATE(table<std::string, std::string>({
      {"AssertionError: No inf checks were recorded for this optimizer.",
       "scaler.step(optimizer) found no gradient in any of the optimizer's parameters"},
      {"RuntimeError: unscale_() has already been called on this optimizer since the last update().",
       "Call scaler.unscale_(optimizer) once per optimizer per step, after the step's last backward"},
      {"RuntimeError: unscale_() is being called after step().", "Unscale and clip before the optimizer steps"},
      {"RuntimeError: step() has already been called since the last update().",
       "Call scaler.update() once after each step's scaler.step() calls"},
      {"AssertionError: Attempted step but _scale is None.  This may indicate your script did not use "
       "scaler.scale(loss or outputs) earlier in the iteration.",
       "Scale the loss before its backward: scaler.scale(loss).backward()"},
      {"AssertionError: No inf checks were recorded prior to update.",
       "Call scaler.step(optimizer) before scaler.update() in each step"},
      {"RuntimeError: Closure use is not currently supported if GradScaler is enabled.",
       "GradScaler cannot step an optimizer with a closure"},
  }));
  const Report r = report_raised_at_step_3(raised);
  const Finding& f = required(r, "training-raised");
  CHECK(f.severity == Severity::kWarning);
  CHECK_THAT(f.evidence, !Catch::Contains(".;"));  // torch's full stop dropped before the run.db's count
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions.front().summary, Catch::StartsWith(fix));
}

TEST_CASE("a 'No inf checks' refusal after the agent saw the step's gradients set to None says to move zero_grad()",
          "[rules][raised]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("gradients-set-to-none", "this step's backward reached 6 of the optimizer's parameters, and every .grad was "
                                   "None when the scaler unscaled them: something set them to None in between, as "
                                   "optimizer.zero_grad() does");
  f.event("training-raised", "AssertionError: No inf checks were recorded for this optimizer.");
  f.finish();
  CHECK_THROWS_WITH(load_run(dir.file("run.db")),
                    Catch::Contains("the training raised AssertionError: No inf checks were recorded for this "
                                    "optimizer. The step's backward reached the optimizer's parameters") &&
                        Catch::Contains("never between backward and scaler.step()"));
}

TEST_CASE("a constant float16 cannot hold, refused before the first step, is told to use the dtype's own limit",
          "[rules][raised]") {
  // SimCLR's similarities masked with -1e9 on their diagonal, as float32 code does, under
  // fp16 autocast: torch refuses the fill.
  TempDir dir;
  raised_before_step_0(dir.file("run.db"), "RuntimeError: value cannot be converted to type c10::Half without overflow");
  CHECK_THROWS_WITH(load_run(dir.file("run.db")),
                    Catch::Contains("without overflow. A constant beyond float16's range (65504) was written into a "
                                    "float16 tensor") &&
                        Catch::Contains("masked_fill(mask, torch.finfo(scores.dtype).min)"));
}

TEST_CASE("the same refusal after recorded steps, in older torch's words, gets the same fix", "[rules][raised]") {
  const Report r = report_raised_at_step_3("RuntimeError: value cannot be converted to type at::Half without overflow");
  const Finding& f = required(r, "training-raised");
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions.front().summary, Catch::StartsWith("A constant beyond float16's range (65504)"));
}

namespace {

const char* kLstmRefused =
    "RuntimeError: could not create a primitive descriptor for the LSTM forward propagation primitive. Run workload "
    "with environment variable ONEDNN_VERBOSE=all to get additional diagnostic information.";

// A run.db the agent `source` wrote, whose training raised kLstmRefused before any step, the
// exception having left module `raised_in` ("rnn (LSTM)", event "training-raised-in").
std::string lstm_refused_at_start(const TempDir& dir, const std::string& source, const std::string& raised_in) {
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("source", source);
  f.event("training-raised", kLstmRefused).event("training-raised-in", raised_in);
  f.finish();
  return dir.file("run.db");
}

}  // namespace

TEST_CASE("oneDNN refusing a float16 LSTM before the first step says to run the module it raised in in FP32",
          "[rules][raised]") {
  // torch.autocast("cpu", dtype=torch.float16) around an nn.LSTM: the Python agent read the
  // module from the traceback (event "training-raised-in").
  TempDir dir;
  CHECK_THROWS_WITH(load_run(lstm_refused_at_start(dir, "ampdiag Python agent", "enc.rnn (LSTM)")),
                    Catch::Contains("information. torch's CPU kernels (oneDNN) have no float16 LSTM on this CPU") &&
                        Catch::Contains("run enc.rnn in FP32 (ampdiag.pin_fp32(model.enc.rnn))") &&
                        Catch::Contains("dtype=torch.bfloat16"));
}

TEST_CASE("the same refusal in a LibTorch run names the C++ pin and dtype, not Python's", "[rules][raised]") {
  TempDir dir;
  CHECK_THROWS_WITH(load_run(lstm_refused_at_start(dir, "ampdiag C++ agent", "rnn (LSTM)")),
                    Catch::Contains("run rnn in FP32 (ampdiag::Fp32Pins, ampdiag/pin_fp32.h)") &&
                        Catch::Contains("autocast in at::kBFloat16") && !Catch::Contains("pin_fp32(model") &&
                        !Catch::Contains("torch.bfloat16"));
}

TEST_CASE("oneDNN refusing a float16 GRU after some steps, with no module read, names the layer's kind",
          "[rules][raised]") {
  const Report r = report_raised_at_step_3(
      "RuntimeError: could not create a primitive descriptor for the GRU forward propagation primitive.");
  const Finding& f = required(r, "training-raised");
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions[0].summary, Catch::Contains("no float16 GRU on this CPU") &&
                                           Catch::Contains("run the GRU in FP32, autocast off inside it"));
}

TEST_CASE("another oneDNN refusal gets no recurrent layer's fix", "[rules][raised]") {
  const Report r = report_raised_at_step_3(
      "RuntimeError: could not create a primitive descriptor for a convolution forward propagation primitive");
  CHECK(required(r, "training-raised").suggestions.empty());
}
