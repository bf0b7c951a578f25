// unreached-layers: the parameters an optimizer holds whose gradient never arrived (event
// "parameters-unreached"), told apart from a small module the task leaves unused
// (tests/scenarios/test_unreached_layers.py runs the real loop).
#include "rule_test.h"

namespace {

// 10 healthy steps, with event "parameters-unreached" `detail`.
Report unreached(const TempDir& dir, const std::string& detail) {
  RunFixture f(dir.file("run.db"), {"blocks.0.weight", "blocks.1.weight", "pooler.weight", "head.weight"});
  f.event("parameters-unreached", detail);
  for (int i = 0; i < 10; ++i) f.step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("most of the values an optimizer holds without a gradient are unreached layers, a warning",
          "[rules][unreached]") {
  // A reentrant checkpoint over a frozen embedding's output: its blocks get no gradient.
  TempDir dir;
  const Report r = unreached(dir, "8192 of 9216 values, 2 of 4 parameters the optimizers hold: blocks.0.weight, "
                                  "blocks.1.weight");
  const Finding& f = required(r, "unreached-layers");
  CHECK(f.severity == Severity::kWarning);
  CHECK(f.title == "2 of the 4 parameters the optimizer holds never received a gradient (89% of their values): the "
                   "backward from the loss never reached them, so they do not train");
  CHECK((f.layer == "blocks.0.weight" && f.module == "blocks.0"));
  CHECK_THAT(f.evidence, Catch::StartsWith("by step 0 no gradient of blocks.0.weight, blocks.1.weight had arrived"));
  CHECK_THAT(f.suggestions.front().python, Catch::Contains("use_reentrant=False"));
}

TEST_CASE("a small module an optimizer holds without a gradient is no unreached layers", "[rules][unreached]") {
  // A Hugging Face pooler the masked-LM task does not use.
  TempDir dir;
  const Report r = unreached(dir, "512 of 9216 values, 1 of 4 parameters the optimizers hold: pooler.weight");
  CHECK(find(r, "unreached-layers") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("unreached layers name six parameters and count the others", "[rules][unreached]") {
  // Encodec's encoder behind its quantizer's integer codes: 34 parameters.
  TempDir dir;
  std::string names;
  for (int i = 0; i < 10; ++i) names += (i ? ", " : "") + std::string("blocks.") + std::to_string(i) + ".weight";
  const Report r = unreached(dir, "8192 of 9216 values, 10 of 12 parameters the optimizers hold: " + names);
  CHECK_THAT(required(r, "unreached-layers").evidence,
             Catch::StartsWith("by step 0 no gradient of blocks.0.weight, blocks.1.weight, blocks.2.weight, "
                               "blocks.3.weight, blocks.4.weight, blocks.5.weight and 4 more had arrived"));
}
