// An fp16 run without a working GradScaler: one that was disabled is told to be enabled, or,
// where torch turned off a scaler made for a device the machine lacks, to be made for the run's
// own; a loss scaled by hand before backward() gets torch's GradScaler in its place, and its
// gradients, read after code that may divide them again, no underflow warning.
#include "rule_test.h"

namespace {

// 10 steps without a GradScaler, b.weight's gradients 60% zero and 20% fp16-subnormal; the
// agent's event `kind` says `why` (by default "scaler-disabled").
Report disabled_scaler_run(const TempDir& dir, const std::string& why, const std::string& kind = "scaler-disabled") {
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("scaler_enabled", "0").event(kind, why);
  f.zeros_fraction("b.weight", 0.6, 0.2);
  for (int i = 0; i < 10; ++i) f.step(1, 1);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an fp16 run whose GradScaler torch disabled for a device it lacks is told to make it for the run's own",
          "[rules]") {
  // timm's NativeScaler() on a CPU-only machine: a GradScaler for cuda, which torch turns off.
  TempDir dir;
  const Report r = disabled_scaler_run(dir, "the GradScaler made for cuda is disabled: torch turns it off where no "
                                            "cuda device is available, and the model trains on cpu; there is no loss "
                                            "scale");
  const Suggestion& fix = required(r, "underflow").suggestions.front();
  CHECK_THAT(fix.summary, Catch::StartsWith("Create the GradScaler for cpu: it was made for cuda"));
  CHECK_THAT(fix.python, Catch::StartsWith("scaler = torch.amp.GradScaler(\"cpu\")"));
}

TEST_CASE("an fp16 run whose GradScaler was disabled is told to enable it, not to add one", "[rules]") {
  // GradScaler(enabled=use_amp) with use_amp off while autocast still runs in fp16.
  TempDir dir;
  const Report r = disabled_scaler_run(dir, "the GradScaler is disabled (enabled=False)");
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  CHECK_THAT(u->suggestions.front().summary, Catch::StartsWith("Enable the loss scaler"));
  CHECK_THAT(u->suggestions.front().python, Catch::Contains("enabled=True"));
}

TEST_CASE("an fp16 run that scales its loss by hand is told to use a GradScaler in its place, as information",
          "[rules]") {
  // apex-style: (loss * 1024).backward(), the gradients divided by 1024 before the step, which
  // is where the agent reads them without a GradScaler.
  TempDir dir;
  const Report r = disabled_scaler_run(dir, "ToCopy:float32, MseLoss:float32, Mul(1024):float32", "loss-code-first");
  CHECK(r.healthy());
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.evidence, Catch::Contains("; the loss code multiplies the loss by 1024 before backward() (a loss scale "
                                         "set by hand)"));
  CHECK_THAT(u.suggestions.front().summary,
             Catch::StartsWith("Use torch.amp.GradScaler in place of the loss scale of 1024 set by hand"));
}

TEST_CASE("an fp16 run whose loss code ends in a product by 1 is told to add a loss scaler", "[rules]") {
  TempDir dir;
  const Report r = disabled_scaler_run(dir, "ToCopy:float32, MseLoss:float32, Mul(1):float32", "loss-code-first");
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kWarning);
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Use a loss scaler"));
}
