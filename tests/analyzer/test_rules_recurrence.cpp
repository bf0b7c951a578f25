// A module called again and again in one forward (a hand-written recurrence, a weight-shared
// layer), whose output grows by a steady factor each call until it overflows fp16: the growth
// is the cause, bounding the state is the fix, and an FP32 pin only postpones the overflow.
#include <cmath>

#include "rule_test.h"

namespace {

// Four steps whose forwards call cell.rec ten times, with these |outputs| (NaN: went NaN/Inf),
// then out, NaN/Inf too; its FP32 replay finite up to 70000.
Report recurrent(const TempDir& dir, const std::vector<double>& calls) {
  RunFixture f(dir.file("run.db"), {"cell.rec.weight", "out.weight"});
  f.finite_replay("cell.rec", 70000.0);
  for (int i = 0; i < 4; ++i) {
    for (const double absmax : calls) f.activation("cell.rec", std::isnan(absmax), std::isnan(absmax) ? 0.0 : absmax);
    f.activation("out", true).step(65536, 32768, 1000, {}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

// 1, 4, 16, ... 16384, then NaN/Inf at the ninth call of ten.
const std::vector<double> kGrowing{1, 4, 16, 64, 256, 1024, 4096, 16384, kNaN, kNaN};

}  // namespace

TEST_CASE("a module whose output grows call by call until it overflows is titled by its growth", "[rules][recurrence]") {
  TempDir dir;
  const Report r = recurrent(dir, kGrowing);
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK(fw.module == "cell.rec");
  CHECK(fw.title == "cell.rec's output grows about 4x with each of its calls in a forward, and overflows fp16 at call 9 of 10");
  CHECK_THAT(fw.evidence, Catch::Contains("in step 0's forward it ran 10 times: its |output| rose from 1 at call 1 to "
                                          "1.64e+04 at call 8 (above the call before in 7 of 7), about 4x a call, then "
                                          "went NaN/Inf at call 9"));
}

TEST_CASE("bounding the state comes before the pins, which only postpone a growing module's overflow",
          "[rules][recurrence]") {
  TempDir dir;
  const Report r = recurrent(dir, kGrowing);
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.suggestions.size() == 3);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Keep the state that cell.rec is called on from growing"));
  CHECK_THAT(fw.suggestions[0].summary,
             Catch::Contains("Pinned to FP32, it would go on growing for 1 more call in that forward, to about 2.62e+05 "
                             "by its last"));
  CHECK_THAT(fw.suggestions[0].python, Catch::Contains("torch.tanh(self.rec(h) + u)"));
  CHECK(fw.suggestions[0].untried);
  CHECK_THAT(fw.suggestions[1].python, Catch::StartsWith("ampdiag.pin_fp32(model.cell)"));
  CHECK(fw.suggestions[1].untried);
  CHECK_THAT(fw.suggestions[1].summary, Catch::EndsWith("The growth goes on in FP32, and beyond fp16's range by its last call."));
}

TEST_CASE("a module called many times whose output wanders before it overflows is not said to grow", "[rules][recurrence]") {
  TempDir dir;
  const Report r = recurrent(dir, {1, 500, 2, 800, 3, 2000, 5, 4000, kNaN, kNaN});
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK(fw.title == "cell.rec is the first module whose output is NaN/Inf in forward");
  CHECK_THAT(fw.evidence, !Catch::Contains("times: its |output| rose"));
  CHECK_THAT(fw.suggestions.front().summary, Catch::StartsWith("Run cell in FP32"));
}

TEST_CASE("a module whose output grew only tenfold over its calls is not said to grow", "[rules][recurrence]") {
  TempDir dir;
  const Report r = recurrent(dir, {1, 1.5, 2, 3, 4, 5, 7, 9, kNaN, kNaN});
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK(fw.title == "cell.rec is the first module whose output is NaN/Inf in forward");
}

TEST_CASE("a module run a few times in a forward says at which of its calls it went NaN/Inf", "[rules][recurrence]") {
  // ALBERT's shared block, six passes: too few finite calls to call it a growth.
  TempDir dir;
  const Report r = recurrent(dir, {388, 5000, 52100, kNaN, kNaN, kNaN});
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK(fw.title == "cell.rec is the first module whose output is NaN/Inf in forward");
  CHECK_THAT(fw.evidence, Catch::Contains("; it ran 6 times in step 0's forward and went NaN/Inf at call 4, after an "
                                          "|output| of 388 at call 1 and 5.21e+04 at call 3"));
}

TEST_CASE("a module run several times that went NaN/Inf at its first call says so", "[rules][recurrence]") {
  TempDir dir;
  const Report r = recurrent(dir, {kNaN, kNaN, kNaN});
  CHECK_THAT(required(r, "forward-nonfinite").evidence,
             Catch::Contains("; it ran 3 times in step 0's forward and went NaN/Inf at call 1, its first"));
}
