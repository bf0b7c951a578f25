// A block the forward runs again and again, each call taking the last one's output (ALBERT's
// shared layer): its parameters get their gradient once every call's backward has run, and
// a NaN/Inf one call's backward makes reaches the calls before it, so the first of them to
// hold NaN/Inf names a layer that may only have passed it on. With the agent's event
// "chained-calls", overflow-origin names the block and the modules without parameters inside
// it (tests/scenarios/test_shared_layer.py runs a real one).
#include "rule_test.h"

namespace {

// 24 skips halving the scale from 65536, blk.ln.weight's gradient the first NaN/Inf one and
// head.weight's the last finite before it; blk (ffn, act, ln) is called three times a forward,
// act on ffn's outputs, which reach `ffn_peak`.
Finding shared_block_overflow(bool chained, double ffn_peak = 10.0) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"blk.ffn.weight", "blk.ln.weight", "head.weight"});
  f.module_type("blk.ln", "LayerNorm");
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2) {
    if (chained && i == 0) f.event("chained-calls", "blk").event("module-input-from", "blk.act: blk.ffn");
    for (int call = 0; call < 3; ++call)
      f.activation("blk.ffn", false, ffn_peak).activation("blk.act", false).activation("blk.ln", false).activation("blk", false);
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

TEST_CASE("an activation given values whose cube passes fp16's range has its pin before the look for a singular point",
          "[rules]") {
  // ALBERT's gelu_new on FFN outputs near 2e4: the cube inside its backward is Inf, and
  // 0 * Inf is NaN; nothing there evaluates a function at a singular point.
  const Finding o = shared_block_overflow(true, 2.1e4);
  CHECK_THAT(o.evidence, Catch::Contains("blk.act's input, blk.ffn's output, reached 21000, whose cube passes 65504"));
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run blk.act in FP32: blk.act computes on values up to 21000"));
  CHECK(o.suggestions[0].untried);
  CHECK_THAT(o.suggestions[1].summary, Catch::StartsWith("If pinned it still goes NaN/Inf, look at the backward of blk.act"));
}

TEST_CASE("an activation given values of everyday size keeps the look for a singular point first", "[rules]") {
  const Finding o = shared_block_overflow(true, 30.0);
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Look first at the backward of blk.act"));
  CHECK_THAT(o.evidence, !Catch::Contains("whose cube passes"));
}
