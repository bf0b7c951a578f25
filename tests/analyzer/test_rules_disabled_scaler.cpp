// An fp16 run whose GradScaler was disabled: its underflow is told to enable it, or, where
// torch turned off a scaler made for a device the machine lacks, to make it for the run's own.
#include "rule_test.h"

namespace {

// 10 steps without a loss scale, b.weight's gradients 60% zero and 20% fp16-subnormal; the
// agent's event "scaler-disabled" says `why`.
Report disabled_scaler_run(const TempDir& dir, const std::string& why) {
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("scaler_enabled", "0").event("scaler-disabled", why);
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
