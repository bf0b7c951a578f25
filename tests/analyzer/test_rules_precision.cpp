// precision-loss: a module whose output under autocast is far from the same call in FP32
// (the agent's precision checks) while nothing goes NaN/Inf.
#include "rule_test.h"

namespace {

// `steps` healthy steps; at each, the modules in `errors` checked with those relative errors
// (one module a step, in turn, as the agent checks them).
Report checked(const TempDir& dir, const std::vector<std::pair<std::string, double>>& errors, int steps = 8,
               std::int64_t zeroed = 0, double fp32_absmax = 4.0, const std::string& amp_dtype = "float16") {
  RunFixture f(dir.file("run.db"), {"norm.weight", "head.weight"});
  f.meta("amp_dtype", amp_dtype);
  for (int i = 0; i < steps; ++i) {
    const auto& [module, error] = errors[std::size_t(i) % errors.size()];
    f.precision_check(module, error, error > 0.1 ? zeroed : 0, fp32_absmax).step(65536, 65536, 1000);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a module whose fp16 output is mostly wrong is an error with its pin", "[rules][precision]") {
  TempDir dir;
  const Report r = checked(dir, {{"norm", 0.98}, {"head", 0.0004}}, 8, 900);
  const Finding* f = find(r, "precision-loss");
  REQUIRE(f != nullptr);
  CHECK(f->severity == Severity::kError);
  CHECK(f->module == "norm");
  CHECK(f->title == "norm loses its output to float16: 98 % away from the same call in FP32, without NaN/Inf");
  CHECK_THAT(f->evidence, Catch::StartsWith("in 4 of 4 checks (steps 0, 2, 4, 6)"));
  CHECK_THAT(f->evidence, Catch::Contains("the other checked modules were 0.04 % away (median), rounding alone"));
  CHECK_THAT(f->evidence, Catch::Contains("up to 88 % of its values came out exactly 0 where FP32's were not"));
  REQUIRE(f->suggestions.size() == 1);
  CHECK_THAT(f->suggestions[0].python, Catch::StartsWith("ampdiag.pin_fp32(model.norm)"));
  CHECK_THAT(render_text(r, Gate("error")), Catch::Contains("(confirmed by replay)"));
  CHECK(!r.healthy());
}

TEST_CASE("a module with some of its output lost is a warning", "[rules][precision]") {
  TempDir dir;
  const Report r = checked(dir, {{"norm", 0.2}});
  const Finding* f = find(r, "precision-loss");
  REQUIRE(f != nullptr);
  CHECK(f->severity == Severity::kWarning);
  CHECK_THAT(f->evidence, !Catch::Contains("exactly 0"));
}

TEST_CASE("modules within rounding of FP32 give no finding", "[rules][precision]") {
  TempDir dir;
  const Report r = checked(dir, {{"norm", 0.003}, {"head", 0.0004}});
  CHECK(find(r, "precision-loss") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("a module far from FP32 in a minority of its checks is not named", "[rules][precision]") {
  // A routing decision flipped by rounding moves one check, not most of them.
  TempDir dir;
  const Report r = checked(dir, {{"norm", 0.5}, {"head", 0.001}, {"norm", 0.002}, {"norm", 0.001}});
  CHECK(find(r, "precision-loss") == nullptr);
}

TEST_CASE("a container far from FP32 because of its lossy child is not named; the child is", "[rules][precision]") {
  TempDir dir;
  const Report r = checked(dir, {{"block", 0.9}, {"block.norm", 0.95}, {"block.fc", 0.001}});
  std::vector<std::string> named;
  for (const auto& f : r.findings)
    if (f.rule == "precision-loss") named.push_back(f.module);
  CHECK(named == std::vector<std::string>{"block.norm"});
}

TEST_CASE("a lossy module whose FP32 output is beyond fp16's range gets its parent pinned", "[rules][precision]") {
  TempDir dir;
  const Report r = checked(dir, {{"block.proj", 0.6}}, 4, 0, 2e5);
  const Finding* f = find(r, "precision-loss");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->suggestions.front().python, Catch::StartsWith("ampdiag.pin_fp32(model.block)"));
  CHECK(f->suggestions.front().untried);
}

TEST_CASE("a bf16 run's precision loss names bfloat16, not fp16's range", "[rules][precision]") {
  TempDir dir;
  const Report r = checked(dir, {{"norm", 0.7}}, 4, 900, 4.0, "bfloat16");
  const Finding* f = find(r, "precision-loss");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->title, Catch::StartsWith("norm loses its output to bfloat16"));
  CHECK_THAT(f->evidence, Catch::Contains("came out exactly 0") && !Catch::Contains("65504"));
}

TEST_CASE("the threshold is the report's --precision-error", "[rules][precision]") {
  TempDir dir;
  checked(dir, {{"norm", 0.05}});
  Thresholds t;
  t.precision_error = 0.01;
  const Report strict = analyze({load_run(dir.file("run.db"))}, t);
  CHECK(find(strict, "precision-loss") != nullptr);
}

TEST_CASE("a module auto-pinned for the output its precision check found lost says so", "[rules][precision]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"norm.weight", "head.weight"});
  f.precision_check("norm", 0.97, 900).event("autopin-precision", "norm: 97 % away from FP32").step(65536, 65536);
  f.event("autopin", "norm");
  for (int i = 0; i < 3; ++i) f.precision_check("norm", 0.0001).step(65536, 65536);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* pinned = find(r, "autopin");
  REQUIRE(pinned != nullptr);
  CHECK(pinned->title == "auto-pinned norm to FP32 at step 1; after it, 0 skips");
  CHECK_THAT(pinned->evidence, Catch::StartsWith("a precision check found its float16 output 97 % away from FP32"));
  CHECK(find(r, "precision-loss") == nullptr);  // lost in 1 of 4 checks: the pin made the rest whole
}

TEST_CASE("an autopin whose limit left the next confirmed module unpinned says so and how to pin more",
          "[rules][autopin]") {
  // T5 with every block's wo too large: autopin=True pins block 0's, block 1's is confirmed
  // next and the skips go on; the finding explains them.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"b0.wo.weight", "b1.wo.weight"});
  f.step(65536, 32768, 1000, {"b0.wo.weight"});
  f.event("autopin", "b0");
  f.event("autopin-limit", "b1 was confirmed too, but autopin=1 modules are pinned already; pin it in code if the "
                           "report names it");
  for (int i = 0; i < 3; ++i) f.step(32768 >> i, 16384 >> i, 1000, {"b1.wo.weight"});
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* pinned = find(r, "autopin");
  REQUIRE(pinned != nullptr);
  CHECK_THAT(pinned->evidence, Catch::EndsWith("; then b1 was confirmed too and left unpinned: autopin=1 allows 1 module"));
  REQUIRE(pinned->suggestions.size() == 2);
  CHECK_THAT(pinned->suggestions[1].python, Catch::Contains("autopin=4"));
}

namespace {

// b0.wo goes NaN/Inf first in forward at steps 0, 1 and at `again` (-1: never again);
// ampdiag pins its block b0 from step 2 on.
Report autopinned_run(int again) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"b0.wo.weight", "b1.wo.weight"});
  for (int i = 0; i < 8; ++i) {
    const bool bad = i < 2 || i == again;
    if (i == 2) f.event("autopin", "b0");
    f.activation("b0.wo", bad);
    f.step(65536, bad ? 32768 : 65536, 1000, bad ? std::vector<std::string>{"b0.wo.weight"} : std::vector<std::string>{},
           bad ? std::nan("") : 0.5);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a forward overflow that stopped once autopin pinned its module says the pin held", "[rules][autopin]") {
  const Report r = autopinned_run(-1);
  const Finding& f = required(r, "forward-nonfinite");
  CHECK(f.module == "b0.wo");
  CHECK_THAT(f.evidence, Catch::Contains("ampdiag pinned b0 to FP32 at step 2 (autopin), and it has not been first "
                                         "since: the pin held in training"));
}

TEST_CASE("a forward overflow that went on after autopin pinned its module says how often", "[rules][autopin]") {
  const Report r = autopinned_run(5);
  const Finding& f = required(r, "forward-nonfinite");
  CHECK_THAT(f.evidence, Catch::Contains("ampdiag pinned b0 to FP32 at step 2 (autopin), and it was still first in 1 "
                                         "step after"));
}
