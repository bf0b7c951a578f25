// per-sample-gradients: per-sample gradients (Opacus's grad_sample) under a GradScaler, which
// neither unscales nor checks them: a warning; an error where they held NaN/Inf at a step the
// scaler applied, whose update nonfinite-update then traces to them (tests/scenarios/
// test_dp_sgd.py runs the same cases as a real torch loop).
#include "rule_test.h"

namespace {

const char* kHeld = "4 of the optimizer's parameters carry per-sample gradients (grad_sample, float16, as Opacus's "
                    "DP-SGD keeps them: a.weight of shape [32, 64, 16])";

// A run under a GradScaler at 65536 whose optimizer's parameters carry per-sample gradients.
// `nonfinite_at`: the step their NaN/Inf is recorded at (-1: none), which the scaler skipped
// where `skipped`; where `update_made_nan`, the parameters were found NaN/Inf in the step after
// it and every step from then on went NaN/Inf and was skipped.
Report dp_run(const TempDir& dir, int nonfinite_at, bool skipped = false, bool update_made_nan = false,
              const std::string& scaler_enabled = "1") {
  RunFixture f(dir.file("run.db"), {"a.weight", "a.bias"});
  f.meta("scaler_enabled", scaler_enabled).event("per-sample-gradients", kHeld);
  for (int i = 0; i < 6; ++i) {
    if (i == nonfinite_at) f.event("per-sample-nonfinite", "the per-sample gradients of a.weight held NaN/Inf");
    if (update_made_nan && i == nonfinite_at + 1) f.event("parameters-nonfinite", "1 of 2 parameter tensors: a.weight");
    if (update_made_nan && i > nonfinite_at) {
      f.step(65536, 32768, 1000, {"a.weight"});
    } else if (i == nonfinite_at && skipped) {
      f.step(65536, 32768, 1000, {"a.weight"});
    } else {
      f.step(65536, 65536);
    }
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("per-sample gradients under a GradScaler are warned of: it neither unscales nor checks them", "[rules]") {
  TempDir dir;
  const Report r = dp_run(dir, -1);
  CHECK(r.findings.size() == 1);
  const Finding* p = find(r, "per-sample-gradients");
  REQUIRE(p != nullptr);
  CHECK(p->severity == Severity::kWarning);
  CHECK_THAT(p->evidence, Catch::StartsWith(kHeld));
  CHECK_THAT(p->evidence, Catch::Contains("at a loss scale of 65536 its max_grad_norm bounds them times the scale"));
  REQUIRE(!p->suggestions.empty());
  CHECK_THAT(p->suggestions.front().summary, Catch::StartsWith("Train the DP-SGD loop without a GradScaler"));
}

TEST_CASE("per-sample gradients that held NaN/Inf at a step the scaler applied are an error", "[rules]") {
  TempDir dir;
  const Report r = dp_run(dir, 2);
  const Finding* p = find(r, "per-sample-gradients");
  REQUIRE(p != nullptr);
  CHECK(p->severity == Severity::kError);
  CHECK(p->steps == std::vector<std::int64_t>{2});
  CHECK_THAT(p->evidence, Catch::Contains("at step 2 the per-sample gradients of a.weight held NaN/Inf while .grad was "
                                          "finite, so the scaler applied the step"));
}

TEST_CASE("per-sample gradients that held NaN/Inf at a step the scaler skipped stay a warning", "[rules]") {
  TempDir dir;
  const Report r = dp_run(dir, 2, true);
  const Finding* p = find(r, "per-sample-gradients");
  REQUIRE(p != nullptr);
  CHECK(p->severity == Severity::kWarning);
}

TEST_CASE("the NaN/Inf update made from per-sample gradients leads with dropping the GradScaler", "[rules]") {
  TempDir dir;
  const Report r = dp_run(dir, 1, false, true);
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK_THAT(u->title, Catch::Contains("from finite gradients, by step 1's update"));
  CHECK_THAT(u->evidence, Catch::Contains("; at step 1 the per-sample gradients of a.weight held NaN/Inf, which the DP "
                                          "optimizer clips and sums into the update"));
  REQUIRE(u->suggestions.size() == 1);
  CHECK_THAT(u->suggestions.front().summary, Catch::StartsWith("Train the DP-SGD loop without a GradScaler"));
}

TEST_CASE("per-sample gradients without a GradScaler are no finding", "[rules]") {
  TempDir dir;
  const Report r = dp_run(dir, -1, false, false, "0");
  CHECK(find(r, "per-sample-gradients") == nullptr);
}
