// loss-divergence: a loss that grew by orders of magnitude while finite before the NaN/Inf
// came is the cause, and the module that overflowed first is only where it showed
// (tests/scenarios/test_divergence.py trains a real loop with a learning rate too high).
#include <cmath>

#include "rule_test.h"

namespace {

// One step per loss: a finite one with every output finite at the scale it has reached; a
// NaN one whose module `enc` went NaN/Inf in forward, the scale halving.
Report losses_run(const TempDir& dir, const std::vector<double>& losses) {
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (double loss : losses) {
    if (std::isnan(loss)) {
      f.activation("enc", true).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
      scale /= 2;
    } else {
      f.activation("enc", false).step(scale, scale, 1000, {}, loss);
    }
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

// No loss-divergence in `r`: the module that went NaN/Inf first keeps its error.
void check_not_a_divergence(const Report& r) {
  CHECK(find(r, "loss-divergence") == nullptr);
  const Finding* fwd = find(r, "forward-nonfinite");
  REQUIRE(fwd != nullptr);
  CHECK(fwd->severity == Severity::kError);
}

// Losses `finite`, then `nan_steps` NaN ones.
Report run_of(const TempDir& dir, std::vector<double> finite, int nan_steps) {
  finite.insert(finite.end(), std::size_t(nan_steps), kNaN);
  return losses_run(dir, finite);
}

}  // namespace

TEST_CASE("a loss that grew a thousandfold while finite before NaN is named first", "[rules][divergence]") {
  TempDir dir;
  const auto r = run_of(dir, {2.0, 2.1, 1.9, 2.0, 2.2, 30.0, 400.0, 5000.0, 60000.0}, 12);
  REQUIRE_FALSE(r.findings.empty());
  const Finding& first = r.findings.front();
  CHECK(first.rule == "loss-divergence");
  CHECK(first.severity == Severity::kError);
  CHECK(first.steps == std::vector<std::int64_t>{5});
  CHECK_THAT(first.evidence, Catch::Contains("above 10x that from step 5, above 1000x from step 7") &&
                                 Catch::Contains("the loss NaN/Inf from step 9"));
  CHECK_THAT(first.suggestions.front().summary, Catch::StartsWith("Lower the learning rate"));
}

TEST_CASE("the module that overflowed after the climb is a warning that points to the divergence",
          "[rules][divergence]") {
  TempDir dir;
  const auto r = run_of(dir, {2.0, 2.1, 1.9, 2.0, 2.2, 30.0, 400.0, 5000.0, 60000.0}, 12);
  const Finding* fwd = find(r, "forward-nonfinite");
  REQUIRE(fwd != nullptr);
  CHECK(fwd->severity == Severity::kWarning);
  CHECK_THAT(fwd->suggestions.front().summary, Catch::StartsWith("The loss was diverging (see loss-divergence)"));
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK_THAT(collapse->suggestions.front().summary, Catch::Contains("see loss-divergence"));
}

TEST_CASE("a loss spike that comes back before the NaN is not a divergence", "[rules][divergence]") {
  TempDir dir;
  check_not_a_divergence(run_of(dir, {2.0, 2.1, 1.9, 2.0, 2.2, 3000.0, 2.5, 2.1, 2.0}, 12));
}

TEST_CASE("a loss that only grows, with no NaN/Inf after, is not reported", "[rules][divergence]") {
  TempDir dir;
  const auto r = run_of(dir, {2.0, 2.1, 1.9, 2.0, 2.2, 30.0, 400.0, 5000.0, 60000.0}, 0);
  CHECK(find(r, "loss-divergence") == nullptr);
  CHECK_FALSE(Gate("error").fails(r));
}

TEST_CASE("a NaN in forward before the climb keeps its error", "[rules][divergence]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (double loss : {2.0, 2.1, 1.9, 2.0, 2.2}) f.activation("enc", false).step(65536, 65536, 1000, {}, loss);
  f.activation("enc", true).step(65536, 32768, 1000, {"head.weight"}, kNaN);
  for (double loss : {30.0, 400.0, 5000.0, 60000.0}) f.activation("enc", false).step(32768, 32768, 1000, {}, loss);
  for (int i = 0; i < 6; ++i) f.activation("enc", true).step(32768, 32768, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE(find(r, "loss-divergence") != nullptr);
  const Finding* fwd = find(r, "forward-nonfinite");
  REQUIRE(fwd != nullptr);
  REQUIRE_FALSE(fwd->steps.empty());
  CHECK(fwd->steps.front() == 5);
  CHECK(fwd->severity == Severity::kError);
}

TEST_CASE("a loss that went NaN during its climb, short of a thousandfold, is not a divergence", "[rules][divergence]") {
  // A learning rate that overflows fp16 while the loss has grown 40x: between the NaN losses
  // one step at a lowered scale is finite and 1000x the start. The loss did not grow
  // "while finite": it went NaN first.
  TempDir dir;
  check_not_a_divergence(losses_run(dir, {2.0, 2.1, 1.9, 2.0, 2.2, 30.0, 80.0, kNaN, kNaN, kNaN, kNaN, 2500.0, kNaN,
                                           kNaN, kNaN, kNaN, kNaN, kNaN}));
}

TEST_CASE("a climb that starts again after the loss came back down is still a divergence", "[rules][divergence]") {
  TempDir dir;
  const auto r = losses_run(dir, {2.0, 2.1, 1.9, 2.0, 2.2, 40.0, kNaN, 2.1, 2.0, 30.0, 400.0, 5000.0, 60000.0, kNaN,
                                  kNaN, kNaN, kNaN, kNaN, kNaN});
  const Finding* div = find(r, "loss-divergence");
  REQUIRE(div != nullptr);
  CHECK(div->steps == std::vector<std::int64_t>{9});
}

TEST_CASE("a loss that rose the step parameters were added is put on them, not on the learning rate",
          "[rules][divergence]") {
  // A block grown into a trained model at a scale far too large: the loss is 1500 times
  // its start from that step on, then NaN.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 5; ++i) f.activation("enc", false).step(65536, 65536, 1000, {}, 2.0);
  f.event("parameters-added", "extra.weight was added to the model after attach(): its gradients are recorded ...");
  f.event("parameters-added", "extra.bias was added to the model after attach(): its gradients are recorded ...");
  for (int i = 0; i < 3; ++i) f.activation("enc", false).step(65536, 65536, 1000, {}, 3000.0);
  double scale = 65536;
  for (int i = 0; i < 4; ++i, scale /= 2) f.activation("enc", true).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding& d = required(r, "loss-divergence");
  CHECK(d.severity == Severity::kError);
  CHECK(d.title == "The loss rose at step 5, the step parameters were added to the model (extra.weight, extra.bias), "
                   "and grew 1500x before the NaN/Inf");
  CHECK_THAT(d.suggestions.front().summary, Catch::StartsWith("Look at what was added at step 5"));
  const Finding& fwd = required(r, "forward-nonfinite");
  CHECK(fwd.severity == Severity::kWarning);
  CHECK_THAT(fwd.suggestions.front().summary, Catch::StartsWith("The loss rose where parameters were added"));
}

TEST_CASE("parameters added long before the climb leave the learning-rate reading", "[rules][divergence]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("parameters-added", "extra.weight was added to the model after attach(): its gradients are recorded ...");
  std::vector<double> losses = {2, 2, 2, 2, 2, 30, 300, 3000, 30000};
  for (double loss : losses) f.activation("enc", false).step(65536, 65536, 1000, {}, loss);
  double scale = 65536;
  for (int i = 0; i < 4; ++i, scale /= 2) f.activation("enc", true).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK_THAT(required(r, "loss-divergence").title, Catch::StartsWith("The loss diverged before anything overflowed"));
}
