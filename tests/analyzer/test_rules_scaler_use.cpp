// An optimizer stepped outside scaler.step() (event "optimizer-outside-scaler", which the
// Python agent records): the NaN/Inf it applied is that loop's bug, named first, and the
// findings it causes point to it (tests/scenarios/test_scaler_misuse.py runs the real loops).
#include "rule_test.h"

namespace {

const char* kScaled =
    "SGD.step() ran on gradients still multiplied by the loss scale (1024): scaler.step(optimizer) was not called";
const char* kUnscaled =
    "SGD.step() ran after scaler.unscale_(optimizer) but outside scaler.step(): a step whose gradients hold NaN/Inf "
    "is applied instead of skipped";

// Five steps at `scale` with nothing overflowing, and the event where `detail` is given.
Report quiet_run(const TempDir& dir, const char* detail, double scale) {
  RunFixture f(dir.file("run.db"), kLayers);
  if (detail) f.event("optimizer-outside-scaler", detail);
  for (int i = 0; i < 5; ++i) f.step(scale, scale);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("gradients applied still multiplied by the scale are the first error, and the NaN update points to it",
          "[rules][scaler-use]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("optimizer-outside-scaler", kScaled);
  for (int i = 0; i < 5; ++i) f.step(1024, 1024);
  f.taken().step(1024, 1024, 1000, {"head.weight", "b.weight"});
  for (int i = 0; i < 5; ++i) f.taken().step(1024, 1024, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE_FALSE(r.findings.empty());
  const Finding& first = r.findings.front();
  CHECK(first.rule == "optimizer-outside-scaler");
  CHECK(first.severity == Severity::kError);
  CHECK_THAT(first.evidence, Catch::Contains("6 steps applied NaN/Inf gradients, first step 5") &&
                                 Catch::Contains("the loss is NaN/Inf from step 6"));
  CHECK_THAT(first.suggestions.front().python, Catch::Contains("scaler.step(optimizer)  # not optimizer.step()"));
  const Finding* update = find(r, "nonfinite-update");
  REQUIRE(update != nullptr);
  CHECK_THAT(update->suggestions.front().summary, Catch::StartsWith("Step the optimizer through the scaler"));
}

TEST_CASE("gradients applied multiplied by the scale fail the gate before anything overflows", "[rules][scaler-use]") {
  // Every update is `scale` times too large from the first: an error even while finite.
  TempDir dir;
  const auto r = quiet_run(dir, kScaled, 1024);
  const Finding* o = find(r, "optimizer-outside-scaler");
  REQUIRE(o != nullptr);
  CHECK(o->severity == Severity::kError);
  CHECK(Gate("error").fails(r));
}

TEST_CASE("an optimizer stepped after unscale_ with no overflow yet is a warning", "[rules][scaler-use]") {
  TempDir dir;
  const auto r = quiet_run(dir, kUnscaled, 65536);
  const Finding* o = find(r, "optimizer-outside-scaler");
  REQUIRE(o != nullptr);
  CHECK(o->severity == Severity::kWarning);
  CHECK_THAT(o->evidence, Catch::Contains("no step's gradients held NaN/Inf yet"));
  CHECK_FALSE(Gate("error").fails(r));
}

TEST_CASE("an optimizer stepped after unscale_ that applied an overflow is an error ahead of the collapse it caused",
          "[rules][scaler-use]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("optimizer-outside-scaler", kUnscaled);
  double scale = 65536;
  f.taken().step(scale, scale / 2, 1000, {"head.weight"});
  for (int i = 0; i < 12; ++i, scale /= 2) f.taken().step(scale / 2, scale / 4, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE_FALSE(r.findings.empty());
  CHECK(r.findings.front().rule == "optimizer-outside-scaler");
  CHECK(r.findings.front().severity == Severity::kError);
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK_THAT(collapse->suggestions.front().summary, Catch::Contains("see optimizer-outside-scaler"));
}

TEST_CASE("without the event no optimizer-outside-scaler finding is made", "[rules][scaler-use]") {
  TempDir dir;
  const auto r = quiet_run(dir, nullptr, 1024);
  CHECK(find(r, "optimizer-outside-scaler") == nullptr);
}

TEST_CASE("a backward on the unscaled loss is an error that says to call backward on scale's output",
          "[rules][scaler-use]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("unscaled-backward", "backward() ran on the loss given to scaler.scale() (scale 65536), not on its output");
  for (int i = 0; i < 5; ++i) f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* u = find(r, "unscaled-backward");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kError);
  CHECK(Gate("error").fails(r));
  CHECK_THAT(u->evidence, Catch::Contains("from step 0, backward() ran on the loss given to scaler.scale()") &&
                              Catch::Contains("every update was 1.52588e-05 of its gradient"));
  CHECK_THAT(u->suggestions.front().python, Catch::StartsWith("scaler.scale(loss).backward()  # not loss.backward()"));
}

TEST_CASE("underflow of gradients that never held the scale points to the backward, not to a higher scale",
          "[rules][scaler-use]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("unscaled-backward", "backward() ran on the loss given to scaler.scale() (scale 65536), not on its output");
  f.zeros_fraction("b.weight", 0.5, 0.3);
  for (int i = 0; i < 5; ++i) f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* under = find(r, "underflow");
  REQUIRE(under != nullptr);
  REQUIRE(under->suggestions.size() == 1);
  CHECK_THAT(under->suggestions.front().summary, Catch::Contains("see unscaled-backward"));
}

namespace {

// 10 steps at 65536 whose head.weight overflows in `held` of them (the first ones), the scale
// kept where `kept`, else halved; with event "update-new-scale" where `said`.
Report held_run(const TempDir& dir, int held, bool kept, bool said = false) {
  RunFixture f(dir.file("run.db"), kLayers);
  if (said) f.event("update-new-scale", "65536");
  double scale = 65536;
  for (int i = 0; i < 10; ++i) {
    const bool overflows = i < held;
    const double after = overflows && !kept ? scale / 2 : scale;
    f.step(scale, after, 1000, overflows ? std::vector<std::string>{"head.weight"} : std::vector<std::string>{});
    scale = after;
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("skipped steps whose scale did not back off are a scale held by hand, the first error", "[rules][scaler-use]") {
  TempDir dir;
  const Report r = held_run(dir, 10, true, true);
  REQUIRE_FALSE(r.findings.empty());
  const Finding& first = r.findings.front();
  CHECK(first.rule == "scale-held");
  CHECK(first.severity == Severity::kError);
  CHECK_THAT(first.evidence, Catch::StartsWith("10 of 10 skipped steps kept their scale (up to 65536 before and after; "
                                               "steps 0, 1, 2, 3, 4, 5, ...)") &&
                                 Catch::EndsWith("scaler.update(new_scale=65536) set it, from step 0"));
  const Finding& origin = required(r, "overflow-origin");
  CHECK(origin.severity == Severity::kWarning);
  CHECK_THAT(origin.suggestions.front().summary, Catch::StartsWith("The scale is held by hand (see scale-held)"));
  CHECK_THAT(required(r, "skip-rate").suggestions.front().summary, Catch::StartsWith("The scale is held by hand"));
}

TEST_CASE("a scale held without the agent's event is said to be set after the back-off", "[rules][scaler-use]") {
  TempDir dir;
  const Report r = held_run(dir, 10, true);
  CHECK_THAT(required(r, "scale-held").evidence,
             Catch::EndsWith("something sets it after the back-off: update(new_scale=...), a second update() or "
                             "load_state_dict()"));
}

TEST_CASE("skipped steps whose scale backed off are no scale held", "[rules][scaler-use]") {
  TempDir dir;
  const Report r = held_run(dir, 4, false);
  CHECK(find(r, "scale-held") == nullptr);
}

TEST_CASE("one skipped step that kept its scale is no scale held", "[rules][scaler-use]") {
  TempDir dir;
  const Report r = held_run(dir, 1, true);
  CHECK(find(r, "scale-held") == nullptr);
}
