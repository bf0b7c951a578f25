// unreached-layers: trainable layers no gradient ever reached, told apart from a module the
// task leaves unused (tests/scenarios/test_unreached_layers.py runs the real loop).
#include "rule_test.h"

namespace {

// 10 steps whose gradients reach only `reached` of the layers (blocks.0.weight and
// blocks.1.weight [64, 64], pooler.weight and head.weight [8, 64]).
Report reaching(const TempDir& dir, const std::vector<std::string>& reached) {
  const std::vector<std::string> layers = {"blocks.0.weight", "blocks.1.weight", "pooler.weight", "head.weight"};
  RunFixture f(dir.file("run.db"), layers, 0, 1, "float32", {},
               {{"blocks.0.weight", {64, 64}}, {"blocks.1.weight", {64, 64}}, {"pooler.weight", {8, 64}},
                {"head.weight", {8, 64}}});
  for (int i = 0; i < 10; ++i) f.step(65536, 65536, 1000, {}, 0.5, reached);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("most trainable values never reached by a gradient are unreached layers, a warning", "[rules][unreached]") {
  // A reentrant checkpoint over a frozen embedding's output: its blocks get no gradient.
  TempDir dir;
  const Report r = reaching(dir, {"pooler.weight", "head.weight"});
  const Finding& f = required(r, "unreached-layers");
  CHECK(f.severity == Severity::kWarning);
  CHECK(f.title == "2 of 4 trainable layers never received a gradient (89% of the trainable values): the backward "
                   "from the loss never reached them, so they do not train");
  CHECK_THAT(f.evidence, Catch::StartsWith("in 10 steps no gradient of blocks.0.weight, blocks.1.weight arrived, while "
                                           "pooler.weight's did"));
  CHECK_THAT(f.suggestions.front().python, Catch::Contains("use_reentrant=False"));
}

TEST_CASE("a small module no gradient reaches is no unreached layers", "[rules][unreached]") {
  // A Hugging Face pooler the masked-LM task does not use.
  TempDir dir;
  const Report r = reaching(dir, {"blocks.0.weight", "blocks.1.weight", "head.weight"});
  CHECK(find(r, "unreached-layers") == nullptr);
  CHECK(r.healthy());
}
