// overflow-origin: an overflow between two parameters of a module the agent never saw run
// (torch's MultiheadAttention uses out_proj's weights in its own forward) is the module's
// that uses them, which a pin can reach; out_proj's own pin would change nothing.
#include "rule_test.h"

namespace {

// attn.out_proj.bias goes Inf first, just after attn.out_proj.weight arrived finite, at
// every step from a scale of 65536 down; attn and head ran (`out_proj_ran`: out_proj too).
Report out_proj_overflow_run(const TempDir& dir, bool out_proj_ran) {
  RunFixture f(dir.file("run.db"), {"attn.in_proj_weight", "attn.out_proj.weight", "attn.out_proj.bias", "head.weight"});
  f.module_type("attn", "MultiheadAttention");
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    if (out_proj_ran) f.activation("attn.out_proj", false);
    f.activation("attn", false).activation("head", false);
    f.finite_first({"head.weight", "attn.out_proj.weight"}).step(scale, scale / 2, 1000, {"attn.out_proj.bias"});
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an overflow inside a module that never ran its forward is its caller's", "[rules][unprobed]") {
  TempDir dir;
  const Report r = out_proj_overflow_run(dir, false);
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "attn");
  CHECK(o.layer == "attn.out_proj.bias");
  bool pins_attn = false;
  for (const auto& s : o.suggestions) {
    CHECK_THAT(s.python, !Catch::Contains("pin_fp32(model.attn.out_proj)"));
    pins_attn = pins_attn || s.python.rfind("ampdiag.pin_fp32(model.attn)", 0) == 0;
  }
  CHECK(pins_attn);
}

TEST_CASE("an overflow inside a module that ran its forward stays its own", "[rules][unprobed]") {
  TempDir dir;
  const Report r = out_proj_overflow_run(dir, true);
  CHECK(required(r, "overflow-origin").module == "attn.out_proj");
}
