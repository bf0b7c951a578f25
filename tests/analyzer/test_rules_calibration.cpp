// Which skips are the scaler's calibration (its descent from init_scale) or growth probes,
// and which hurt the run: skip-rate and the overflow-origin severity they decide.
#include "rule_test.h"

namespace {

// The run's overflow-origin finding: the head's, as information.
const Finding& head_origin_as_information(const Report& r) {
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module == "head");
  CHECK(o->severity == Severity::kInfo);
  return *o;
}

}  // namespace

TEST_CASE("a scale that settles at 4096 and probes for growth is not a collapse", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 4; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"a.weight"});  // calibration
  for (int i = 0; i < 10; ++i) {  // grows after its interval, overflows, backs off: 14 back-offs in all
    for (int k = 0; k < 5; ++k) f.step(scale, scale);
    f.step(scale, scale * 2);
    f.step(scale * 2, scale, 1000, {"a.weight"});
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "scale-collapse") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("a layer whose only skip calibrated the scale is information while forward NaNs push the skip rate up",
          "[rules]") {
  // The run's harmful skips are a module's forward NaN (forward-nonfinite's); the layer's
  // one overflow was the first step's, at init_scale.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.replay("attn", "intrinsic");
  f.activation("attn", false).step(65536, 32768, 1000, {"head.weight"});
  for (int i = 1; i < 20; ++i) {
    if (i % 7 == 3)
      f.activation("attn", true).step(32768, 32768, 1000, {"head.weight", "a.weight"}, kNaN);
    else
      f.activation("attn", false).step(32768, 32768);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(head_origin_as_information(r).suggestions.empty());
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->module == "attn");
}

TEST_CASE("an overflow within the skip rate quotes the skips it counts, not the calibration's", "[rules]") {
  // Three skips down from 65536, then 4 overflows in 60 steps: 7 of 63 skipped in all, and
  // 4 of 60 (7%) as the skip rate counts them.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 3; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"});
  for (int i = 0; i < 60; ++i) {
    if (i % 15 == 14) {
      f.step(scale, scale / 2, 1000, {"head.weight"});
      scale /= 2;
    } else {
      f.step(scale, scale);
    }
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK_THAT(head_origin_as_information(r).evidence,
             Catch::Contains("the run's skips, not counting those that calibrated the scale or answered its growth "
                             "probes, 4 of 60 steps (7 of 63 with them), stay within the 10% threshold"));
}

TEST_CASE("calibration and growth-probe skips are not harmful", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 32768, 1000, {"head.weight"}).step(32768, 16384, 1000, {"head.weight"});
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 9; ++i) f.step(16384, 16384);
    f.step(16384, 32768);
    f.step(32768, 16384, 1000, {"head.weight"});  // the growth probe overflows
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->severity == Severity::kInfo);
}

TEST_CASE("a scale coming down from init_scale between successful steps is calibrating, not skipping", "[rules]") {
  // What a real scaler does when batches differ: an overflow, a step that fits, another
  // batch that does not, until it settles (4 skips in 20 steps, 2 after the first success).
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 32768, 1000, {"head.weight"}).step(32768, 16384, 1000, {"head.weight"}).step(16384, 16384);
  f.step(16384, 8192, 1000, {"head.weight"}).step(8192, 8192).step(8192, 8192);
  f.step(8192, 4096, 1000, {"head.weight"});
  for (int i = 0; i < 13; ++i) f.step(4096, 4096);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  CHECK(find(r, "skip-rate") == nullptr);
  CHECK(r.runs.front().calibration_skips == 4);
  CHECK(r.runs.front().harmful_skips == 0);
}

TEST_CASE("skips after the scale settled still count, and the calibration before is named", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 32768, 1000, {"head.weight"}).step(32768, 16384).step(16384, 8192, 1000, {"head.weight"});
  for (int i = 0; i < 6; ++i) f.step(8192, 8192);  // settled
  double scale = 8192;
  for (int i = 0; i < 4; ++i, scale /= 2) {  // then one step in four overflows
    f.step(scale, scale / 2, 1000, {"head.weight"});
    for (int k = 0; k < 3; ++k) f.step(scale / 2, scale / 2);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* s = find(r, "skip-rate");
  REQUIRE(s != nullptr);
  CHECK_THAT(s->evidence, Catch::Contains("4 of 23 steps skipped (not counting 2 skipped at the start"));
  CHECK(r.runs.front().calibration_skips == 2);
}

TEST_CASE("a scale still coming down when the run ends is not excused as calibration", "[rules]") {
  // Never 5 steps in a row without an overflow, never a growth: it has not settled.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"}).step(scale / 2, scale / 2).step(scale / 2, scale / 2);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "skip-rate") != nullptr);
  CHECK(r.runs.front().calibration_skips == 1);
}

TEST_CASE("a short run that backs off once from 65536 after a step that fit passes the gate", "[rules]") {
  // A 5-step smoke run: its descent from init_scale has not had time to settle, but the
  // scale is still high; its one skip is the scaler finding its level, not a culprit.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 65536).step(65536, 32768, 1000, {"head.weight"}).step(32768, 32768).step(32768, 32768).step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK_FALSE(Gate("error").fails(r));
  CHECK(find(r, "skip-rate") == nullptr);
  CHECK(r.runs.front().calibration_skips == 1);
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->severity == Severity::kInfo);
}

TEST_CASE("a short run whose skips had NaN/Inf in forward still fails the gate", "[rules]") {
  // Its scale is still high when it ends, but forward made the NaN/Inf: no scale helps.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).activation("head", false).step(65536, 65536);
  for (int i = 0; i < 2; ++i) {
    const double scale = 65536 / double(1 << i);
    f.activation("enc", true).activation("head", true).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  }
  f.activation("enc", false).activation("head", false).step(16384, 16384);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(Gate("error").fails(r));
  const Finding* fwd = find(r, "forward-nonfinite");
  REQUIRE(fwd != nullptr);
  CHECK(fwd->module == "enc");
}

TEST_CASE("a loss scale is printed as the power of two it is, not rounded to six digits", "[rules]") {
  // init_scale=2**24: "%g" printed 1.67772e+07.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 16777216;
  for (int i = 0; i < 4; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"a.weight"});
  for (int i = 0; i < 8; ++i) f.step(scale, scale);
  f.finish();
  const std::string text = render_text(report_of(dir.file("run.db")), Gate("error"));
  CHECK_THAT(text, Catch::Contains("loss scale 16777216 -> 1048576 (lowest 1048576)"));
}

namespace {

// A scaler whose growth_interval is `interval`, coming down from 65536 to 8192 in three skips.
void descend_to_8192(RunFixture& f, int interval) {
  f.meta("scaler_growth_interval", std::to_string(interval));
  f.step(65536, 32768, 1000, {"head.weight"}).step(32768, 16384, 1000, {"head.weight"});
  f.step(16384, 8192, 1000, {"head.weight"});
}

// After coming down from 65536 it settles at 8192, and each `interval` steps it doubles to
// 16384, which overflows and is skipped.
Report probing_run(const TempDir& dir, int interval, int steps = 80) {
  RunFixture f(dir.file("run.db"), kLayers);
  descend_to_8192(f, interval);
  for (int i = 0; i < steps; ++i) {
    if ((i + 1) % (interval + 1) == 0)
      f.step(16384, 8192, 1000, {"head.weight"});  // the probe
    else
      f.step(8192, (i + 2) % (interval + 1) == 0 ? 16384 : 8192);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("growth probes that skip half the steps are an error naming growth_interval", "[rules]") {
  TempDir dir;
  const auto r = probing_run(dir, 1);
  const Finding* s = find(r, "skip-rate");
  REQUIRE(s != nullptr);
  CHECK(s->severity == Severity::kError);
  CHECK_THAT(s->title, Catch::StartsWith("50% of optimizer steps were skipped by the scaler's own growth probes"));
  CHECK_THAT(s->evidence, Catch::Contains("growth_interval=1"));
  REQUIRE_FALSE(s->suggestions.empty());
  CHECK_THAT(s->suggestions.front().python, Catch::EndsWith("init_scale=2.0**13, growth_interval=2000)"));
  CHECK(r.runs.front().harmful_skips == 0);  // the overflows themselves are the scaler's probing
}

TEST_CASE("growth probes every eight steps are still the scaler's own work", "[rules]") {
  TempDir dir;
  const auto r = probing_run(dir, 8);
  CHECK(find(r, "skip-rate") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("under a collapse the loss code's NaNs took down, a layer whose only skip calibrated the scale is information",
          "[rules]") {
  // A focal loss's log() of fp16 probabilities: the head's gradient overflows once, at
  // init_scale; from step 1 on the loss itself is NaN in every step, which every scale
  // skips, down to 2^-13. Pinning the head would change nothing.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("a", false).activation("head", false).step(65536, 32768, 1000, {"head.weight", "a.weight"});
  double scale = 32768;
  for (int i = 0; i < 28; ++i, scale /= 2)
    f.activation("a", false).activation("head", false).step(scale, scale / 2, 1000, {"head.weight", "a.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = &head_origin_as_information(r);
  CHECK(o->title == "head went NaN/Inf first only at loss scales above the floor; steps whose loss or forward went "
                    "NaN/Inf took the scale below it");
  CHECK_THAT(o->evidence, Catch::EndsWith("the skips that took it below the floor of 128 were steps whose loss or "
                                          "forward went NaN/Inf"));
  CHECK(o->suggestions.empty());
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kError);
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK_THAT(collapse->suggestions.front().summary, Catch::StartsWith("Fix the NaN/Inf made in") ||
                                                        Catch::Contains("(see forward-nonfinite)"));
}

namespace {

// Settled at 8192 with growth_interval `held`: each try climbs to 16384, holds it `held`
// steps, tries 32768, which overflows, and then overflows again back at 16384 on the way down.
Report climbing_run(const TempDir& dir, int held) {
  RunFixture f(dir.file("run.db"), kLayers);
  descend_to_8192(f, held);
  for (int cycle = 0; cycle < 10; ++cycle) {
    f.step(8192, 16384);
    for (int i = 1; i < held; ++i) f.step(16384, 16384);
    f.step(16384, 32768);
    f.step(32768, 16384, 1000, {"head.weight"});  // the probe
    f.step(16384, 8192, 1000, {"head.weight"});
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a skip coming back down from a growth probe to a scale held one step is the probe's", "[rules]") {
  TempDir dir;
  const auto r = climbing_run(dir, 1);
  CHECK(r.runs.front().harmful_skips == 0);
  head_origin_as_information(r);
  const Finding* s = find(r, "skip-rate");
  REQUIRE(s != nullptr);
  CHECK_THAT(s->title, Catch::Contains("by the scaler's own growth probes"));
  CHECK_THAT(s->evidence, Catch::Contains("10 of 40 steps were skipped right after the scale grew"));
  CHECK_THAT(s->evidence, Catch::Contains("and 10 more as it came back down"));
}

TEST_CASE("a skip coming back down from a growth probe to a scale held for steps hurts", "[rules]") {
  TempDir dir;
  const auto r = climbing_run(dir, 6);
  CHECK(r.runs.front().harmful_skips == 10);
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->severity == Severity::kError);
}
