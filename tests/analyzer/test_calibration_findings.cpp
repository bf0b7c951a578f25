// The information findings of a scale's calibration made one where three or more modules
// each went NaN/Inf first in its skips (a ConvMixer's nine halvings, each in another block).
#include "rule_test.h"

namespace {

// The scale halving from 65536 in one skip for each of `firsts` (the layer that went
// NaN/Inf first there), then 10 finite steps at the scale reached.
Report calibrating(const TempDir& dir, const std::vector<std::string>& firsts) {
  RunFixture f(dir.file("run.db"), {"a.weight", "b.weight", "c.weight", "head.weight"});
  double scale = 65536;
  for (const auto& first : firsts) {
    f.step(scale, scale / 2, 1000, {first});
    scale /= 2;
  }
  for (int i = 0; i < 10; ++i) f.step(scale, scale, 1000);
  f.finish();
  return report_of(dir.file("run.db"));
}

std::size_t overflow_origins(const Report& r) {
  std::size_t n = 0;
  for (const auto& f : r.findings) n += f.rule == "overflow-origin";
  return n;
}

}  // namespace

TEST_CASE("three modules each first in a skip of the scale's calibration are one information finding",
          "[rules][calibration]") {
  TempDir dir;
  const Report r = calibrating(dir, {"head.weight", "c.weight", "b.weight"});
  REQUIRE(overflow_origins(r) == 1);
  const Finding& f = required(r, "overflow-origin");
  CHECK(f.severity == Severity::kInfo);
  CHECK(f.title == "3 modules went NaN/Inf first, each in skips that only calibrated the loss scale or answered its "
                   "growth probes; the loss scale copes with it");
  CHECK(f.module == "head");
  CHECK_THAT(f.evidence, Catch::StartsWith("the first gradient to hold NaN/Inf was in head (step 0), c (step 1), b "
                                           "(step 2)"));
  CHECK(r.healthy());
}

TEST_CASE("two modules each first in a skip of the scale's calibration stay two findings", "[rules][calibration]") {
  TempDir dir;
  const Report r = calibrating(dir, {"head.weight", "c.weight"});
  CHECK(overflow_origins(r) == 2);
}

namespace {

// Each of `firsts` first in one skip halving the scale from 65536, then stem.weight first in
// skips that take it from there down to 32, below the floor, where it stays.
Report calibrating_then_collapsing(const TempDir& dir, const std::vector<std::string>& firsts) {
  RunFixture f(dir.file("run.db"), {"stem.weight", "a.weight", "b.weight", "c.weight", "head.weight"});
  double scale = 65536;
  for (const auto& first : firsts) {
    f.step(scale, scale / 2, 1000, {first});
    scale /= 2;
  }
  while (scale > 32) {
    f.step(scale, scale / 2, 1000, {"stem.weight"});
    scale /= 2;
  }
  for (int i = 0; i < 10; ++i) f.step(scale, scale, 1000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("three modules first only above the floor beside the one that took the scale below it are one finding",
          "[rules][calibration]") {
  // An Inception v3 from scratch: seven branches first as the scale came down, then its stem
  // convolution's gradients held it at 32.
  TempDir dir;
  const Report r = calibrating_then_collapsing(dir, {"head.weight", "c.weight", "b.weight"});
  std::vector<const Finding*> above;
  for (const auto& f : r.findings)
    if (f.rule == "overflow-origin" && f.severity == Severity::kInfo) above.push_back(&f);
  REQUIRE(above.size() == 1);
  CHECK(above[0]->title == "3 modules went NaN/Inf first only at loss scales above the floor; stem's overflows took "
                           "the scale below it");
  CHECK_THAT(above[0]->evidence, Catch::StartsWith("the first gradient to hold NaN/Inf was in head (step 0), c (step "
                                                   "1), b (step 2): each in skips that only calibrated the scale"));
}
