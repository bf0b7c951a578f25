// underflow: a bias whose module's output goes straight into a batch normalisation, which
// takes away each channel's mean, is a sum zero by that structure: rounding, even where its
// weight's gradient underflows too and no sibling is in range to set it against (a GIN
// layer's Linear before its BatchNorm1d, on a graph with a hub).
#include "rule_test.h"

namespace {

// fc.bias 95% fp16-subnormal at 1e-6 of the step's gradients; fc.weight 39% zeros and 15%
// subnormal; fc's output given straight to "norm", of type `norm_type`.
Report bias_before_norm_run(const TempDir& dir, const std::string& norm_type) {
  RunFixture f(dir.file("run.db"), {"fc.weight", "fc.bias", "head.weight"});
  f.zeros_fraction("fc.bias", 0.0, 0.95).zeros_fraction("fc.weight", 0.39, 0.15);
  f.module_type("norm", norm_type).event("module-input-from", "norm: fc");
  for (int i = 0; i < 10; ++i) {
    f.activation("fc", false).activation("norm", false).activation("head", false);
    f.clipped(1e-5, {"fc.bias"}).step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a bias straight before a BatchNorm1d whose weight underflows too cancels", "[rules][bias-norm]") {
  TempDir dir;
  const Report r = bias_before_norm_run(dir, "BatchNorm1d");
  const Finding* u = find(r, "underflow", "fc.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kInfo);
  CHECK_THAT(u->title, Catch::StartsWith("fc.bias's gradient cancels to rounding, far below fc.weight's"));
  CHECK_THAT(u->evidence, Catch::Contains("and fc's output goes straight into norm (BatchNorm1d), which takes away each "
                                          "channel's mean"));
}

TEST_CASE("the same bias straight before a LayerNorm stays an underflow", "[rules][bias-norm]") {
  // A LayerNorm takes away each sample's mean over the features, which a per-feature bias
  // does not shift alike.
  TempDir dir;
  const Report r = bias_before_norm_run(dir, "LayerNorm");
  const Finding* u = find(r, "underflow", "fc.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kWarning);
}
