// A tied parameter (an LM's embedding and output head sharing one weight) is registered
// under its first module, and its gradient arrives when every use has added its part. The
// agent's event "tied-gradient-nonfinite" names the module whose use went NaN/Inf first;
// overflow-origin names that module, not the one the tensor is registered under
// (tests/python/test_tied_parameters.py and tests/scenarios/test_tied_weights.py run it).
#include "rule_test.h"

namespace {

// Six skipped steps whose first non-finite gradient is the tied emb.weight, each with the
// event `tied_detail` (none if empty).
Finding tied_overflow(const std::string& tied_detail) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"emb.weight", "norm.weight", "norm.bias"});
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2) {
    if (!tied_detail.empty()) f.event("tied-gradient-nonfinite", tied_detail);
    f.step(scale, scale / 2, 1000, {"emb.weight", "norm.weight"});
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* origin = find(r, "overflow-origin");
  REQUIRE(origin != nullptr);
  CHECK(origin->layer == "emb.weight");
  return *origin;
}

}  // namespace

TEST_CASE("a tied parameter that went NaN/Inf first in the head's use names the head", "[rules]") {
  const Finding origin = tied_overflow("emb.weight through head");
  CHECK(origin.module == "head");
  CHECK_THAT(origin.title, Catch::StartsWith("head overflows first in backward"));
  CHECK_THAT(origin.evidence, Catch::Contains("emb.weight is tied (one tensor held by several modules): head's use of "
                                              "it went NaN/Inf first"));
  CHECK_THAT(origin.suggestions.front().python, Catch::Contains("pin_fp32(model.head)"));
}

TEST_CASE("a tied parameter without the agent's event is named under its own module", "[rules]") {
  const Finding origin = tied_overflow("");
  CHECK(origin.module == "emb");
  CHECK_THAT(origin.evidence, !Catch::Contains("tied"));
}

TEST_CASE("a submodule's parameter whose use by the model's own code went NaN/Inf first names that code", "[rules]") {
  // Logits F.linear(h, self.emb.weight) without a head module: the agent writes "through the model".
  const Finding origin = tied_overflow("emb.weight through the model");
  CHECK(origin.module.empty());
  CHECK_THAT(origin.title, Catch::StartsWith("The model's own forward(), where it uses emb.weight, overflows first"));
  CHECK_THAT(origin.evidence, Catch::Contains("emb.weight is used by the model's own forward() besides its module: that "
                                              "use went NaN/Inf first"));
  CHECK_THAT(origin.evidence, !Catch::Contains("held by several modules"));
}
