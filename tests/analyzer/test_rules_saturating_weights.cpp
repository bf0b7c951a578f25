// oversized-weights where nothing overflowed: a layer far above a standard gain whose own
// gradient is mostly exact zeros saturated what takes its outputs (nanochat's tanh softcap
// under an lm_head 3e4 times too large), a warning with its re-initialisation.
#include "rule_test.h"

namespace {

// head.weight read at a gain of 4800 ([64, 64]: l2 = 8 * gain), then 10 healthy steps whose
// head.weight gradients are `zeros` exact zeros.
Report saturating_head_run(const TempDir& dir, double zeros) {
  RunFixture f(dir.file("run.db"), {"a.weight", "head.weight"});
  f.weight_norm("a.weight", 2.4).weight_norm("head.weight", 8.0 * 4800.0);
  f.zeros_fraction("head.weight", zeros);
  for (int i = 0; i < 10; ++i) f.activation("a", false).activation("head", false).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("oversized weights whose own gradient is mostly exact zeros saturated what follows", "[rules][saturating]") {
  TempDir dir;
  const Report r = saturating_head_run(dir, 0.54);
  const Finding& o = required(r, "oversized-weights");
  CHECK(o.severity == Severity::kWarning);
  CHECK_THAT(o.title, Catch::EndsWith(": 54% of its own gradient was exactly zero, what takes its outputs saturated"));
  REQUIRE(o.suggestions.size() == 1);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise head at a standard scale") &&
                                           !Catch::Contains("the overflow's own fixes"));
}

TEST_CASE("oversized weights whose own gradient has few exact zeros stay information", "[rules][saturating]") {
  TempDir dir;
  const Report r = saturating_head_run(dir, 0.1);
  const Finding& o = required(r, "oversized-weights");
  CHECK(o.severity == Severity::kInfo);
  CHECK(o.suggestions.empty());
}
