// The timeline's level of detail: no skipped step and no scale extreme disappears when far
// more steps than pixels share the plot.
#include <catch2/catch.hpp>

#include <cmath>

#include "timeline.h"

using namespace ampdiag;

namespace {

analyzer::Run run_of(std::int64_t steps, const std::vector<std::int64_t>& skipped) {
  analyzer::Run run;
  for (std::int64_t s = 0; s < steps; ++s) {
    analyzer::StepSummary step;
    step.row.step = s;
    step.row.scale_before = step.row.scale_after = 65536.0;
    run.steps.push_back(step);
  }
  for (auto s : skipped) {
    run.steps[std::size_t(s)].row.skipped = true;
    run.steps[std::size_t(s)].row.scale_after = 32768.0;
  }
  return run;
}

}  // namespace

TEST_CASE("a million steps in a thousand columns keep every skipped step and its scale dip", "[gui]") {
  const auto run = run_of(1000000, {3, 500001, 999999});
  const auto columns = gui::timeline_columns(run, 0, 999999, 1000);
  REQUIRE(columns.size() == 1000);
  int skipped = 0;
  for (const auto& c : columns) {
    REQUIRE(c.any);
    skipped += c.skipped ? 1 : 0;
    if (c.skipped) {
      CHECK(c.lo == 15.0);  // the dip to 2^15 is kept
      CHECK(c.hi == 16.0);
    }
  }
  CHECK(skipped == 3);
  CHECK(columns[0].skipped);
  CHECK(columns[500].skipped);
  CHECK(columns[999].skipped);
}

TEST_CASE("step_to_x puts a step at the centre of its share of the width", "[gui]") {
  CHECK(gui::step_to_x(0, 0, 9, 100.0) == 5.0);
  CHECK(gui::step_to_x(9, 0, 9, 100.0) == 95.0);
}

TEST_CASE("a zoomed range leaves the steps outside it out", "[gui]") {
  const auto run = run_of(100, {10, 90});
  const auto columns = gui::timeline_columns(run, 20, 80, 61);
  for (const auto& c : columns) CHECK_FALSE(c.skipped);
}

TEST_CASE("the scale axis labels every power of two where they fit, and fewer, evenly, where they would stack", "[gui]") {
  CHECK(gui::log2_label_stride(10, 300, 15) == 1);  // 30 px a power
  CHECK(gui::log2_label_stride(18, 190, 15) == 2);  // 10.6 px a power: every other one
  const int stride = gui::log2_label_stride(62, 190, 15);  // a scale that fell 60 halvings, 3 px a power
  CHECK(stride == 8);
  CHECK(190.0 / 62 * stride >= 15);
  CHECK(190.0 / 62 * (stride / 2) < 15);  // no sparser than it needs
}

TEST_CASE("a degenerate axis labels every power", "[gui]") {
  CHECK(gui::log2_label_stride(0, 190, 15) == 1);
  CHECK(gui::log2_label_stride(10, 0, 15) == 1);
}
