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
// puts `amax` (unscaled) in the top binade; values recorded at `scale`.
double normal_share(const analyzer::Fp8Format& fmt, double absmax, double scale) {
  const double amax = absmax / scale;
  const double fp8_scale = std::ldexp(1.0, int(std::floor(std::log2(fmt.max / amax))));
  const double top = std::ldexp(1.0, int(std::floor(std::log2(fmt.max))) + 1);
  double normal = 0;
  for (const auto& [value, count] : {std::pair{absmax, 100.0}, std::pair{1e-3, 3996.0}}) {
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
  CHECK(o.layers == 2);
  CHECK(o.fit_e4m3 == 0);  // as the direct computation above: E4M3 does not fit, E5M2 does
  CHECK(o.fit_e5m2 == 2);
  REQUIRE(o.least_ready.size() == 2);
  CHECK(o.least_ready[0].e4m3_normal == Approx(normal_share(analyzer::kE4M3, 30.0 * 1024, 1024)));
  const auto lines = analyzer::fp8_lines(o);
  REQUIRE(lines.size() == 2);
  CHECK_THAT(lines[0], Catch::Contains("0 of 2 layers fit E4M3, 2 fit E5M2"));
  CHECK_THAT(lines[1], Catch::Contains("least E4M3-ready: small.weight") || Catch::Contains("least E4M3-ready: wide.weight"));
  CHECK_THAT(analyzer::render_json(report, analyzer::Gate("error")), Catch::Contains("\"fit_e5m2\": 2"));
  CHECK_THAT(analyzer::render_text(report, analyzer::Gate("error")), Catch::Contains("FP8 readiness of the gradients"));
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
