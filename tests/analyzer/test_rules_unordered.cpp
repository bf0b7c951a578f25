// Gradients no hook saw arrive (FSDP2's sharded ones, set after the reduce-scatter): no
// backward order, so no layer is named as the first to overflow, and sharded ranks are not
// compared layer by layer.
#include "rule_test.h"

namespace {

const std::vector<std::string> kSharded = {"0.weight", "2.weight", "4.weight"};

// Six steps whose every gradient goes NaN/Inf with no backward order, the scale halving.
Report unordered_overflows(const TempDir& dir) {
  RunFixture f(dir.file("run.db"), kSharded);
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2) f.unordered().step(scale, scale / 2, 1000, kSharded);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("overflows with no backward order name no first layer and suggest no pin", "[rules][unordered]") {
  TempDir dir;
  const Report r = unordered_overflows(dir);
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module.empty());
  CHECK(o->layer.empty());
  CHECK_THAT(o->title, Catch::EndsWith("no backward order was recorded: which layer overflowed first is unknown"));
  for (const auto& finding : r.findings)
    for (const auto& s : finding.suggestions) CHECK_THAT(s.python, !Catch::Contains("pin_fp32"));
}

TEST_CASE("a skipped step with no backward order lists its layers as of unknown order", "[rules][unordered]") {
  TempDir dir;
  const Report r = unordered_overflows(dir);
  REQUIRE_FALSE(r.skipped.empty());
  CHECK_FALSE(r.skipped.front().nonfinite_ordered);
  CHECK_THAT(render_text(r, Gate("error")), Catch::Contains("non-finite gradients in 3 layers, 0.weight, ... (no backward "
                                                            "order recorded: which was first is unknown)"));
}

TEST_CASE("an unordered step beside ordered ones leaves the ordered ones' culprit named", "[rules][unordered]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kSharded);
  for (int i = 0; i < 4; ++i) f.step(65536, 32768, 1000, {"4.weight"});
  f.unordered().step(32768, 16384, 1000, kSharded);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->layer == "4.weight");
  CHECK_THAT(o->evidence, Catch::Contains("in 4 of 4 skipped steps"));
}

TEST_CASE("ranks whose parameters are sharded are not compared layer by layer", "[rules][unordered][ranks]") {
  TempDir dir;
  {
    RunFixture r0(dir.file("run.rank0.db"), kSharded, 0, 2);
    RunFixture r1(dir.file("run.rank1.db"), kSharded, 1, 2);
    r0.event("sharded-parameters", "3 of 3 parameters are DTensors");
    r1.event("sharded-parameters", "3 of 3 parameters are DTensors");
    for (int i = 0; i < 10; ++i) {
      r0.step(65536, 65536);
      r1.step(65536, 65536, 1000, i == 3 ? std::vector<std::string>{"2.weight"} : std::vector<std::string>{});
    }
    r0.finish();
    r1.finish();
  }
  const auto r = analyze({load_run(dir.file("run.rank0.db")), load_run(dir.file("run.rank1.db"))});
  CHECK(find(r, "rank-disagreement") == nullptr);
}
