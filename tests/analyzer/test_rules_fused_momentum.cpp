// fused-sgd-momentum: the Python agent found torch's fused SGD's new momentum buffers unfilled
// after a step the scaler skipped (event fused-momentum-uninitialised). The weights' jump at
// the first applied step and the overflows after it point to it, not to the learning rate
// (tests/python/test_fused_momentum.py runs the real loop, and the fixed ones).
#include "rule_test.h"

namespace {

const char* kUnfilled = "SGD(fused=True, momentum=0.9) created its momentum buffers in this step's scaler.step(), which "
                      "the scaler skipped (NaN/Inf in the gradients): the buffers were left unfilled, holding values "
                      "that are not zeros, and every later step starts its momentum from them";

// Step 0 skipped as the scale calibrates (the buffers created then), step 1 applied, and from
// step 2 the weights 1e22 times what they were and mlp.down's output Inf; `event`: whether
// the agent saw the buffers unfilled.
Report damaged(const TempDir& dir, bool event) {
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  f.event("optimizer-settings", "SGD lr=0.01 weight_decay=0 momentum=0.9");
  if (event) f.event("fused-momentum-uninitialised", kUnfilled);
  f.weight_norms(1.8).step(65536, 32768, 1000, {"head.weight"});
  f.weight_norms(1.8).step(32768, 32768);
  double scale = 32768;
  for (int i = 0; i < 8; ++i, scale /= 2)
    f.weight_norms(1.8e22).activation("mlp.down", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("fused SGD's momentum left unfilled by a skipped first step is the first error", "[rules][fused-momentum]") {
  TempDir dir;
  const Report r = damaged(dir, true);
  REQUIRE_FALSE(r.findings.empty());
  const Finding& f = r.findings.front();
  CHECK(f.rule == "fused-sgd-momentum");
  CHECK(f.severity == Severity::kError);
  CHECK(f.steps == std::vector<std::int64_t>{0});
  CHECK_THAT(f.evidence, Catch::StartsWith("at step 0, SGD(fused=True, momentum=0.9) created its momentum buffers"));
  CHECK_THAT(f.evidence, Catch::Contains("the model's weights (L2 norm) went from 2.54558 at step 1 to 2.54558e+22 "
                                         "at step 2, across the first step applied (1)"));
  REQUIRE(f.suggestions.size() == 1);
  CHECK(f.suggestions.front().python ==
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=0, momentum=0.9)  # not fused=True");
  CHECK(f.suggestions.front().cpp.empty());  // LibTorch's SGD has no fused kernel
}

TEST_CASE("the weights' jump after fused SGD's unfilled momentum is not put on the learning rate",
          "[rules][fused-momentum]") {
  TempDir dir;
  const Report without = damaged(dir, false);
  CHECK(find(without, "weight-growth") != nullptr);  // the same run, unexplained
  TempDir dir2;
  const Report r = damaged(dir2, true);
  CHECK(find(r, "weight-growth") == nullptr);
  CHECK(find(r, "loss-divergence") == nullptr);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kWarning);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("SGD's momentum started from uninitialised memory "
                                                                "(see fused-sgd-momentum): fix that first"));
  CHECK_THAT(fw->evidence, Catch::EndsWith("it comes after step 0, whose skip left fused SGD's new momentum buffers "
                                           "unfilled"));
}

TEST_CASE("the update that wrote NaN from finite gradients after fused SGD's unfilled momentum points to it",
          "[rules][fused-momentum]") {
  // The buffers' garbage drove the weights past float32's range at step 1's update: the agent
  // finds NaN/Inf in the parameters at step 2.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  f.replay("mlp.down", "intrinsic");
  f.event("fused-momentum-uninitialised", kUnfilled);
  f.activation("mlp.down", false).step(65536, 32768, 1000, {"head.weight"});
  f.activation("mlp.down", false).step(32768, 32768);
  f.event("parameters-nonfinite", "1 of 2 parameter tensors: mlp.down.weight");
  double scale = 32768;
  for (int i = 0; i < 4; ++i, scale /= 2)
    f.activation("mlp.down", true).step(scale, scale / 2, 1000, {"head.weight", "mlp.down.weight"}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(r.findings.front().rule == "fused-sgd-momentum");
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK(u->steps == std::vector<std::int64_t>{1});
  CHECK(u->severity == Severity::kWarning);
  CHECK_THAT(u->evidence, Catch::EndsWith("it is the first update after step 0's skip left fused SGD's new momentum "
                                          "buffers unfilled"));
  REQUIRE(u->suggestions.size() == 1);
  CHECK_THAT(u->suggestions.front().summary, Catch::StartsWith("SGD's momentum started from uninitialised memory"));
}
