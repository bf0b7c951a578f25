// FP8 readiness against a direct computation on the values the fixture records: each row
// holds 100 values at its abs-max and the rest at 1e-3 (run_fixture.h).
#include <catch2/catch.hpp>

#include <cmath>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/fp8.h"
#include "ampdiag/analyzer/render.h"
#include "ampdiag/analyzer/run.h"
#include "../rundb/temp_dir.h"
#include "run_fixture.h"

using namespace ampdiag;
using test::RunFixture;
using test::TempDir;

namespace {

// The share of the row's values in `fmt`'s normal binades under a power-of-two scale that
// puts `amax` (unscaled) in the top binade; values recorded at `scale`; 100 of the row's
// 4096 values at `absmax`, the rest at `small`.
double normal_share(const analyzer::Fp8Format& fmt, double absmax, double scale, double small = 1e-3) {
  const double amax = absmax / scale;
  const double fp8_scale = std::ldexp(1.0, int(std::floor(std::log2(fmt.max / amax))));
  const double top = std::ldexp(1.0, int(std::floor(std::log2(fmt.max))) + 1);
  double normal = 0;
  for (const auto& [value, count] : {std::pair{absmax, 100.0}, std::pair{small, 3996.0}}) {
    const double w = value / scale * fp8_scale;
    if (w >= std::ldexp(1.0, fmt.min_normal_exp) && w < top) normal += count;
  }
  return normal / 4096;
}

// Two layers with histograms, 20 steps recorded at scale 1024 with abs-max 30 (unscaled).
void record_two_layers(const std::string& path) {
  RunFixture f(path, {"small.weight", "wide.weight"});
  f.histograms();
  for (int i = 0; i < 20; ++i) f.step(1024, 1024, 30.0 * 1024);
  f.finish();
}

// One layer, one step, no histograms.
void record_without_histograms(const std::string& path) {
  RunFixture f(path, {"w"});
  f.step(1024, 1024, 100.0);
  f.finish();
}

}  // namespace

TEST_CASE("gradient values are placed in E4M3 and E5M2's normal range as a direct computation does", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  record_two_layers(path);
  const auto r = analyzer::fp8_readiness(analyzer::load_run(path));
  REQUIRE(r.histograms);
  REQUIRE(r.layers.size() == 2);
  for (const auto& l : r.layers) {
    CHECK(l.steps == 20);
    CHECK(l.shares[0].normal == Approx(normal_share(analyzer::kE4M3, 30.0 * 1024, 1024)));
    CHECK(l.shares[1].normal == Approx(normal_share(analyzer::kE5M2, 30.0 * 1024, 1024)));
    // 1e-3 at a scale that puts 30 near E4M3's top is below E4M3's normal range, not E5M2's.
    CHECK(l.shares[0].below == Approx(3996.0 / 4096));
    CHECK_FALSE(l.fits[0]);
    CHECK(l.fits[1]);
    CHECK(l.saturated_steps[0] == 0);
  }
  CHECK_FALSE(r.activation_histograms);  // the fixture probed no forward
  CHECK(r.activations.empty());
}

TEST_CASE("activation values are placed in E4M3 and E5M2's normal range as a direct computation does, unscaled",
          "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunFixture f(path, {"w"});
    f.histograms();
    // Recorded at loss scale 1024: forward values carry no loss scale, the reading must not divide by it.
    for (int i = 0; i < 20; ++i) f.activation("proj", false, 3000.0).step(1024, 1024);
    f.finish();
  }
  const auto r = analyzer::fp8_readiness(analyzer::load_run(path));
  REQUIRE(r.activation_histograms);
  REQUIRE(r.activations.size() == 1);
  const auto& a = r.activations[0];
  CHECK(a.name == "proj");
  CHECK(a.steps == 20);
  CHECK(a.shares[0].normal == Approx(normal_share(analyzer::kE4M3, 3000.0, 1.0, 0.1)));
  CHECK(a.shares[1].normal == Approx(normal_share(analyzer::kE5M2, 3000.0, 1.0, 0.1)));
  // 0.1 scaled for 3000 in E4M3's top binade (2^-3) is 0.0125, below 2^-6; E5M2's scale 2^4 keeps it.
  CHECK(a.shares[0].below == Approx(3996.0 / 4096));
  CHECK_FALSE(a.fits[0]);
  CHECK(a.fits[1]);
}

TEST_CASE("a module called twice a step is scaled from the steps before, not from its own earlier call", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunFixture f(path, {"w"});
    f.histograms();
    for (int i = 0; i < 4; ++i) f.activation("shared", false, 20.0).activation("shared", false, 20.0).step(1024, 1024);
    f.activation("shared", false, 100.0).activation("shared", false, 100.0).step(1024, 1024);
    f.finish();
  }
  const auto r = analyzer::fp8_readiness(analyzer::load_run(path));
  REQUIRE(r.activations.size() == 1);
  const auto& a = r.activations[0];
  CHECK(a.steps == 5);
  CHECK(a.saturated_steps[0] == 1);
  // History 20 -> E4M3 scale 2^4: both calls' 100 values at 100 land at 1600, above 448.
  CHECK(a.shares[0].above == Approx(200.0 / (10 * 4096)));
}

TEST_CASE("a non-finite activation is not judged and leaves its step out of the history", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunFixture f(path, {"w"});
    f.histograms();
    f.activation("proj", false, 20.0).step(1024, 1024);
    f.activation("proj", false, 2000.0).activation("proj", true, 2000.0).step(1024, 1024);
    f.activation("proj", false, 100.0).step(1024, 1024);
    f.finish();
  }
  analyzer::Fp8Options o;
  o.history = 1;
  const auto r = analyzer::fp8_readiness(analyzer::load_run(path), o);
  REQUIRE(r.activations.size() == 1);
  // Step 1's finite call is judged; its step (non-finite) is no amax: step 2 is scaled for
  // step 0's 20 and saturates at 100.
  CHECK(r.activations[0].steps == 3);
  CHECK(r.activations[0].saturated_steps[0] == 2);  // step 1 (2000 on 20's scale) and step 2
}

TEST_CASE("a gradient that grows past its amax history saturates on the steps the history did not cover",
          "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunFixture f(path, {"w"});
    f.histograms();
    // Largest |g| 20 for 10 steps, then 100: the first step at 100 is scaled for 20.
    for (int i = 0; i < 10; ++i) f.step(1024, 1024, 20.0 * 1024);
    for (int i = 0; i < 5; ++i) f.step(1024, 1024, 100.0 * 1024);
    f.finish();
  }
  analyzer::Fp8Options o;
  o.history = 4;
  const auto r = analyzer::fp8_readiness(analyzer::load_run(path), o);
  REQUIRE(r.layers.size() == 1);
  // 20 -> scale 2^4 (20 * 16 = 320 <= 448); 100 * 16 = 1600 > 448: only the step the history
  // had not seen yet saturates.
  CHECK(r.layers[0].saturated_steps[0] == 1);
  CHECK(r.layers[0].shares[0].above > 0);
}

TEST_CASE("fp8 readiness says when a run has no histograms, and checks its options", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  record_without_histograms(path);
  const auto run = analyzer::load_run(path);
  CHECK_FALSE(analyzer::fp8_readiness(run).histograms);
  analyzer::Fp8Options bad;
  bad.history = 0;
  CHECK_THROWS_WITH(analyzer::fp8_readiness(run, bad), Catch::Contains("--history"));
}

TEST_CASE("a layer or module that was never finite is named as not judged, not counted as fitting", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunFixture f(path, {"ok.weight", "bad.weight"});
    f.histograms();
    for (int i = 0; i < 3; ++i) f.activation("bad", true).activation("ok", false).step(1024, 1024, 1000.0, {"bad.weight"});
    f.finish();
  }
  const auto r = analyzer::fp8_readiness(analyzer::load_run(path));
  REQUIRE(r.layers.size() == 1);
  CHECK(r.layers[0].name == "ok.weight");
  CHECK(r.unjudged_layers == std::vector<std::string>{"bad.weight"});
  REQUIRE(r.activations.size() == 1);
  CHECK(r.activations[0].name == "ok");
  CHECK(r.unjudged_modules == std::vector<std::string>{"bad"});
}

TEST_CASE("the report's FP8 overview counts the layers that fit and lists the least E4M3-ready", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  record_two_layers(path);
  const std::vector<analyzer::Run> runs = {analyzer::load_run(path)};
  analyzer::Report report = analyzer::analyze(runs);
  CHECK_FALSE(report.runs[0].fp8.recorded);  // analyze() alone does not read the histograms again
  analyzer::add_fp8_overview(report, runs);
  const auto& o = report.runs[0].fp8;
  REQUIRE(o.recorded);
  CHECK(o.gradients.count == 2);
  CHECK(o.gradients.fit_e4m3 == 0);  // as the direct computation above: E4M3 does not fit, E5M2 does
  CHECK(o.gradients.fit_e5m2 == 2);
  REQUIRE(o.gradients.least_ready.size() == 2);
  CHECK(o.gradients.least_ready[0].e4m3_normal == Approx(normal_share(analyzer::kE4M3, 30.0 * 1024, 1024)));
  const auto lines = analyzer::fp8_lines(o);
  REQUIRE(lines.size() == 2);
  CHECK_THAT(lines[0], Catch::Contains("0 of 2 layers fit E4M3, 2 fit E5M2"));
  CHECK_THAT(lines[1], Catch::Contains("least E4M3-ready: small.weight") || Catch::Contains("least E4M3-ready: wide.weight"));
  CHECK_THAT(analyzer::render_json(report, analyzer::Gate("error")), Catch::Contains("\"fit_e5m2\": 2"));
  CHECK_THAT(analyzer::render_text(report, analyzer::Gate("error")), Catch::Contains("FP8 readiness of the gradients"));
  CHECK_FALSE(o.activations_recorded);
  CHECK_THAT(analyzer::render_json(report, analyzer::Gate("error")), Catch::Contains("\"activations\": null"));
}

TEST_CASE("the report's FP8 overview counts the modules whose outputs fit", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunFixture f(path, {"w"});
    f.histograms();
    for (int i = 0; i < 20; ++i) f.activation("wide", false, 3000.0).activation("narrow", false, 1.0).step(1024, 1024);
    f.finish();
  }
  const std::vector<analyzer::Run> runs = {analyzer::load_run(path)};
  analyzer::Report report = analyzer::analyze(runs);
  analyzer::add_fp8_overview(report, runs);
  const auto& o = report.runs[0].fp8;
  REQUIRE(o.activations_recorded);
  CHECK(o.activations.count == 2);
  CHECK(o.activations.fit_e4m3 == 1);  // narrow: 1 and 0.1 both normal; wide: 0.1 falls below (see above)
  CHECK(o.activations.fit_e5m2 == 2);
  REQUIRE(o.activations.least_ready.size() == 1);
  CHECK(o.activations.least_ready[0].name == "wide");
  const auto lines = analyzer::fp8_lines(o);
  REQUIRE(lines.size() == 4);  // the gradients' two lines, then the activations'
  CHECK_THAT(lines[2], Catch::Contains("FP8 readiness of the activations: 1 of 2 modules fit E4M3, 2 fit E5M2"));
  CHECK_THAT(lines[3], Catch::Contains("least E4M3-ready: wide"));
  CHECK_THAT(analyzer::render_json(report, analyzer::Gate("error")),
             Catch::Contains("\"activations\": {\"modules\": 2, \"fit_e4m3\": 1"));
}

TEST_CASE("a run without histograms has no FP8 lines and a null fp8 in JSON", "[fp8]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  record_without_histograms(path);
  const std::vector<analyzer::Run> runs = {analyzer::load_run(path)};
  analyzer::Report report = analyzer::analyze(runs);
  analyzer::add_fp8_overview(report, runs);
  CHECK(analyzer::fp8_lines(report.runs[0].fp8).empty());
  CHECK_THAT(analyzer::render_json(report, analyzer::Gate("error")), Catch::Contains("\"fp8\": null"));
}
