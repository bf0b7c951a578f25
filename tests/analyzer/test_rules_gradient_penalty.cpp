// A loss built from the scaled loss's own gradients (a gradient penalty, event
// "scaled-gradients-in-loss") holds the loss scale: its NaN/Inf at a scale that enlarges
// the gradients is their overflow, which the scaler answers, not a NaN the loss code makes
// (tests/scenarios/test_everyday_loops.py runs PyTorch's recipe as a real torch loop).
#include "rule_test.h"

TEST_CASE("a penalised loss that is Inf while the scale comes down is the scaler's calibration", "[rules][penalty]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("scaled-gradients-in-loss", "a backward with create_graph=True from scaler.scale()'s output");
  double scale = 65536;
  for (int i = 0; i < 4; ++i, scale /= 2) f.activation("enc", false).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  for (int i = 0; i < 30; ++i) f.activation("enc", false).step(scale, scale);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  CHECK(find(r, "forward-nonfinite") == nullptr);
  REQUIRE(r.skipped.size() == 4);
  CHECK(r.skipped.front().forward == ForwardSource::kNone);
}

TEST_CASE("without the event the same Inf losses are made after the modules", "[rules][penalty]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 4; ++i, scale /= 2) f.activation("enc", false).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  for (int i = 0; i < 30; ++i) f.activation("enc", false).step(scale, scale);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE(find(r, "forward-nonfinite") != nullptr);
  CHECK(r.skipped.front().forward == ForwardSource::kLoss);
}

TEST_CASE("a penalised loss still NaN at a scale of 1 and below is the loss code's again", "[rules][penalty]") {
  // No scale enlarges the gradients there: the penalty's NaN is made by the loss code.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("scaled-gradients-in-loss", "a backward with create_graph=True from scaler.scale()'s output");
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2) f.activation("enc", false).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kError);
  CHECK_THAT(fw->evidence, Catch::StartsWith("loss non-finite in 8 of 24 steps, first at step 16"));
}
