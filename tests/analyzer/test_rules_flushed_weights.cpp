// flushed-weights: weight matrices read below float16's smallest positive value (2^-24) while
// their module's output was all zeros (Hugging Face's BLIP vision tower at initializer_range
// 1e-10): an error where they stayed so, a warning where the optimizer lifted them, nothing
// in bf16 or where the output was not zeros; precision-loss leaves the checks they explain.
#include "rule_test.h"

namespace {

// tower.fc.weight read at l2 `start` (abs-max a tenth) at step 0 and `later` from step 1;
// its output all zeros while it is below 2^-24; 6 steps, a precision check of tower at step 0
// 100 % away from FP32 where `checked`.
Report tower_run(const TempDir& dir, double start, double later, const std::string& amp_dtype = "float16",
                 bool checked = false) {
  RunFixture f(dir.file("run.db"), {"tower.fc.weight", "head.weight"});
  f.meta("amp_dtype", amp_dtype);
  for (int i = 0; i < 6; ++i) {
    const double l2 = i == 0 ? start : later;
    f.weight_norm("tower.fc.weight", l2).weight_norm("head.weight", 8.0);
    if (i == 0 && checked) f.precision_check("tower", 1.0);
    f.activation("tower.fc", false, 0.0, 0.0, l2 / 10 < 0x1p-24).activation("tower", false).activation("head", false);
    f.step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("weights below float16's smallest value that stay there are an error", "[rules][flushed]") {
  TempDir dir;
  const Report r = tower_run(dir, 1e-8, 1e-8);
  const Finding& f = required(r, "flushed-weights");
  CHECK(f.severity == Severity::kError);
  CHECK(f.layer == "tower.fc.weight");
  CHECK_THAT(f.title, Catch::StartsWith("tower.fc.weight was below float16's smallest value (5.96e-08) from step 0") &&
                          Catch::EndsWith("its output was all zeros through step 5"));
  REQUIRE(f.suggestions.size() == 2);
  CHECK_THAT(f.suggestions[0].python, Catch::StartsWith("model.get_submodule(\"tower.fc\").reset_parameters()"));
}

TEST_CASE("weights below float16's smallest value that the optimizer lifts are a warning", "[rules][flushed]") {
  TempDir dir;
  const Report r = tower_run(dir, 1e-8, 0.5);
  const Finding& f = required(r, "flushed-weights");
  CHECK(f.severity == Severity::kWarning);
  CHECK_THAT(f.title, Catch::EndsWith("until the optimizer's steps lifted it, by step 1"));
}

TEST_CASE("weights below float16's smallest value are no finding in bfloat16", "[rules][flushed]") {
  TempDir dir;
  const Report r = tower_run(dir, 1e-8, 1e-8, "bfloat16");
  CHECK(find(r, "flushed-weights") == nullptr);
}

TEST_CASE("small weights whose module's output was not zeros are no finding", "[rules][flushed]") {
  // 1e-6 / 10 is above 2^-24: float16 holds them, and the output is not zeros.
  TempDir dir;
  const Report r = tower_run(dir, 1e-6, 1e-6);
  CHECK(find(r, "flushed-weights") == nullptr);
}

TEST_CASE("a precision check made while weights inside were flushed is not precision lost", "[rules][flushed]") {
  TempDir dir;
  const Report r = tower_run(dir, 1e-8, 1e-8, "float16", true);
  CHECK(find(r, "precision-loss") == nullptr);
  CHECK_THAT(required(r, "flushed-weights").evidence,
             Catch::Contains("the agent's check of tower at step 0 found its output 100% away from the same call in FP32"));
}

TEST_CASE("a precision check with no flushed weights inside stays precision lost", "[rules][flushed]") {
  TempDir dir;
  const Report r = tower_run(dir, 8.0, 8.0, "float16", true);
  CHECK(find(r, "precision-loss") != nullptr);
}

TEST_CASE("dead layers whose weights float16 flushes lead with their re-initialisation", "[rules][flushed]") {
  // SAM's image encoder at initializer_range 1e-10: every gradient of it exactly zero.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"tower.fc.weight", "head.weight"}, 0, 1, "float32", {},
               {{"tower.fc.weight", {256, 64}}});
  f.zeros_fraction("tower.fc.weight", 1.0);
  for (int i = 0; i < 8; ++i) {
    f.weight_norm("tower.fc.weight", 1e-8).weight_norm("head.weight", 8.0);
    f.activation("tower.fc", false, 0.0, 0.0, true).activation("head", false).step(65536, 65536);
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& dead = required(r, "dead-layers");
  REQUIRE(dead.suggestions.size() == 2);
  CHECK_THAT(dead.suggestions[0].summary, Catch::StartsWith("Initialise the weights that float16 holds none of"));
  CHECK_THAT(dead.suggestions[1].summary, Catch::StartsWith("Otherwise, look for what zeroes everything after them"));
}
