// dead-layers: most of the trained values with exactly zero gradients in every step while
// others' are not (tests/scenarios/test_dead_layers.py runs the real loop).
#include "rule_test.h"

namespace {

const std::vector<std::string> kMlp = {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"};

// 10 steps of a three-Linear MLP whose layers `dead` get all-zero gradients from step
// `from`; the others' are ordinary.
Report with_dead(const TempDir& dir, const std::vector<std::string>& dead, int from = 0) {
  RunFixture f(dir.file("run.db"), kMlp, 0, 1, "float32", {},
               {{"0.weight", {128, 32}}, {"0.bias", {128}}, {"2.weight", {64, 128}}, {"2.bias", {64}},
                {"4.weight", {10, 64}}, {"4.bias", {10}}});
  for (int i = 0; i < 10; ++i) {
    if (i == from)
      for (const auto& layer : dead) f.zeros_fraction(layer, 1.0);
    f.step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("most trained values with all-zero gradients in every step are dead layers, a warning", "[rules][dead]") {
  // The second ReLU's every input below 0: only the last bias trains.
  TempDir dir;
  const Report r = with_dead(dir, {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight"});
  const Finding& f = required(r, "dead-layers");
  CHECK(f.severity == Severity::kWarning);
  CHECK(f.title == "5 layers' gradients were exactly zero in every step (100% of the trained values): nothing passes "
                   "back through them, so they do not train");
  CHECK_THAT(f.evidence, Catch::Contains("while 4.bias's was not; 4's weight got none while its bias did, so its input "
                                         "was all zeros"));
}

TEST_CASE("a small layer with all-zero gradients is no dead layers", "[rules][dead]") {
  TempDir dir;
  const Report r = with_dead(dir, {"4.weight"});
  CHECK(find(r, "dead-layers") == nullptr);
}

TEST_CASE("gradients zero from a later step to the end are dead layers from that step", "[rules][dead]") {
  // A ReLU that died after a step too large.
  TempDir dir;
  const Report r = with_dead(dir, {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight"}, 3);
  CHECK_THAT(required(r, "dead-layers").title, Catch::StartsWith("5 layers' gradients were exactly zero in every step "
                                                                 "from step 3 (100% of the trained values)"));
}

TEST_CASE("gradients zero only in the first steps are no dead layers", "[rules][dead]") {
  // A LoRA B at 0 leaves A's gradient zero until B has moved.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"lora_A.weight", "lora_B.weight"}, 0, 1, "float32", {},
               {{"lora_A.weight", {8, 64}}, {"lora_B.weight", {64, 8}}});
  f.zeros_fraction("lora_A.weight", 1.0);
  for (int i = 0; i < 10; ++i) {
    if (i == 5) f.zeros_fraction("lora_A.weight", 0.0);
    f.step(65536, 65536);
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(find(r, "dead-layers") == nullptr);
}

namespace {

// 10 steps where module "0"'s output is ordinary and "zeroer" (of type `type`, with nothing
// of its own to train) turns it into all zeros before "2": 0's layers and 2's weight get
// all-zero gradients.
Report zeroed_after(const TempDir& dir, const std::string& type) {
  RunFixture f(dir.file("run.db"), kMlp, 0, 1, "float32", {},
               {{"0.weight", {128, 32}}, {"0.bias", {128}}, {"2.weight", {64, 128}}, {"2.bias", {64}},
                {"4.weight", {10, 64}}, {"4.bias", {10}}});
  for (const char* layer : {"0.weight", "0.bias", "2.weight"}) f.zeros_fraction(layer, 1.0);
  f.module_type("zeroer", type);
  for (int i = 0; i < 10; ++i) {
    f.activation("0", false, 2.4, 100.0).activation("zeroer", false, 0.0, 0.0, true);
    f.activation("2", false, 0.5, 10.0).activation("4", false, 0.5, 10.0);
    f.step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("dead layers behind a frozen norm that zeroes its input name its zero weight", "[rules][dead]") {
  // DETR's timm ResNet built without pretrained weights: each block's last BatchNorm starts at
  // weight 0 and is frozen into a FrozenBatchNorm2d.
  TempDir dir;
  const Report r = zeroed_after(dir, "FrozenBatchNorm2d");
  const Finding& f = required(r, "dead-layers");
  REQUIRE(f.suggestions.size() == 2);
  CHECK_THAT(f.suggestions[0].summary,
             Catch::StartsWith("zeroer (FrozenBatchNorm2d) trains nothing of its own and made all zeros of 0's output, "
                               "which was not zeros: a normalisation whose weight is 0 and frozen"));
  CHECK_THAT(f.suggestions[1].summary, Catch::StartsWith("Otherwise, look for what zeroes everything after them"));
}

TEST_CASE("dead layers behind a ReLU that zeroes its input keep the look for what zeroes them", "[rules][dead]") {
  TempDir dir;
  const Report r = zeroed_after(dir, "ReLU");
  const Finding& f = required(r, "dead-layers");
  REQUIRE(f.suggestions.size() == 1);
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("Look for what zeroes everything after them"));
}
