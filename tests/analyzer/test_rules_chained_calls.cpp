// A block the forward runs again and again, each call taking the last one's output (ALBERT's
// shared layer): its parameters get their gradient once every call's backward has run, and
// a NaN/Inf one call's backward makes reaches the calls before it, so the first of them to
// hold NaN/Inf names a layer that may only have passed it on. With the agent's event
// "chained-calls", overflow-origin names the block and the modules without parameters inside
// it (tests/scenarios/test_shared_layer.py runs a real one).
#include "rule_test.h"

namespace {

// 24 skips halving the scale from 65536, blk.ln.weight's gradient the first NaN/Inf one and
// head.weight's the last finite before it; blk (ffn, act, ln) is called three times a forward.
Finding shared_block_overflow(bool chained) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"blk.ffn.weight", "blk.ln.weight", "head.weight"});
  f.module_type("blk.ln", "LayerNorm");
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2) {
    if (chained && i == 0) f.event("chained-calls", "blk");
    for (int call = 0; call < 3; ++call)
      f.activation("blk.ffn", false).activation("blk.act", false).activation("blk.ln", false).activation("blk", false);
    f.activation("head", false).finite_first({"head.weight"}).step(scale, scale / 2, 1000,
                                                                  {"blk.ln.weight", "blk.ffn.weight"});
  }
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  return required(r, "overflow-origin");
}

}  // namespace

TEST_CASE("a layer inside a block whose calls chain names the block, not the layer", "[rules]") {
  const Finding o = shared_block_overflow(true);
  CHECK(o.module == "blk");
  CHECK(o.layer == "blk.ln.weight");
  CHECK_THAT(o.evidence, Catch::Contains("blk runs again and again in each forward, each call taking the last one's "
                                         "output: the parameters its calls share receive their gradient once every "
                                         "call's backward has run"));
}

TEST_CASE("a block whose calls chain has the modules without parameters inside it pinned, untried", "[rules]") {
  // The NaN/Inf may come from any call's activation: its backward gets its own pin.
  const Finding o = shared_block_overflow(true);
  CHECK_THAT(o.evidence, Catch::Contains("the backward also ran through blk.act, which holds no parameters"));
  const auto pin = std::find_if(o.suggestions.begin(), o.suggestions.end(), [](const Suggestion& s) {
    return s.summary.rfind("If instead a value inside blk.act's backward passes fp16's range", 0) == 0;
  });
  REQUIRE(pin != o.suggestions.end());
  CHECK(pin->untried);
  CHECK_THAT(pin->python, Catch::StartsWith("ampdiag.pin_fp32(model.blk.act)"));
}

TEST_CASE("a layer inside a block run several times without chaining keeps its own name", "[rules]") {
  // One encoder on two views: each call's backward is its own, so the order still says where.
  const Finding o = shared_block_overflow(false);
  CHECK(o.module == "blk.ln");
  CHECK_THAT(o.evidence, !Catch::Contains("runs again and again"));
}
