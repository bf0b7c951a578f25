// What-if scaler replay against an independent simulation: "true" per-step gradient
// magnitudes, recorded under one torch-style scaler (simulated here, step by step, as
// torch._amp_update_scale_ does it), then predicted under another and compared with the
// same simulation run under that other configuration.
#include <catch2/catch.hpp>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "ampdiag/analyzer/run.h"
#include "ampdiag/analyzer/whatif.h"
#include "../rundb/temp_dir.h"
#include "run_fixture.h"

using namespace ampdiag;
using analyzer::ScalerConfig;
using test::RunFixture;
using test::TempDir;

namespace {

constexpr double kFp16Max = 65504.0;

struct Simulated {
  std::vector<double> scales;
  std::vector<bool> skips;
  std::int64_t skipped = 0;
};

// The scaler over true magnitudes m[t] (largest |g| before scaling).
Simulated simulate(const std::vector<double>& m, const ScalerConfig& c) {
  Simulated s;
  double scale = c.init_scale;
  std::int64_t good = 0;
  for (double magnitude : m) {
    s.scales.push_back(scale);
    const bool overflow = magnitude * scale > kFp16Max;
    s.skips.push_back(overflow);
    s.skipped += overflow;
    if (overflow) {
      scale *= c.backoff_factor;
      good = 0;
    } else if (++good == c.growth_interval) {
      scale *= c.growth_factor;
      good = 0;
    }
  }
  return s;
}

// Records the simulated run as the agent would: scaled abs-max on finite steps, Inf on the
// overflowing ones; `every`: statistics on every N-th finite step only.
analyzer::Run record(const std::string& path, const std::vector<double>& m, const ScalerConfig& c, int every = 1,
                     bool histograms = false) {
  const Simulated s = simulate(m, c);
  {
    RunFixture f(path, {"w"});
    if (histograms) f.histograms();
    f.meta("scaler_init_scale", std::to_string(c.init_scale));
    f.meta("scaler_growth_interval", std::to_string(c.growth_interval));
    f.meta("scaler_backoff_factor", std::to_string(c.backoff_factor));
    f.meta("scaler_growth_factor", std::to_string(c.growth_factor));
    for (std::size_t t = 0; t < m.size(); ++t) {
      const double after = t + 1 < m.size() ? s.scales[t + 1] : s.scales[t];
      if (s.skips[t])
        f.step(s.scales[t], after, 1.0, {"w"});
      else if (t % std::size_t(every) == 0)
        f.step(s.scales[t], after, m[t] * s.scales[t]);
      else
        f.step(s.scales[t], after, 1.0, {}, 0.5, {"none"});  // no statistics this step
    }
    f.finish();
  }
  return analyzer::load_run(path);
}

ScalerConfig config(double init, std::int64_t interval, double backoff = 0.5) {
  ScalerConfig c;
  c.init_scale = init;
  c.growth_interval = interval;
  c.backoff_factor = backoff;
  return c;
}

// Smooth magnitudes around `level`, slowly falling, with a few steps twice as large.
std::vector<double> magnitudes(std::size_t n, double level) {
  std::vector<double> m;
  for (std::size_t t = 0; t < n; ++t) m.push_back(level * (1.0 - 0.002 * double(t)) * (t % 17 == 5 ? 2.0 : 1.0));
  return m;
}

}  // namespace

TEST_CASE("replaying the recorded configuration gives back the recorded skips and scales", "[whatif]") {
  TempDir dir;
  const auto m = magnitudes(80, 30.0);
  const ScalerConfig a = config(65536, 5);
  const auto run = record(dir.file("a.db"), m, a);
  const auto truth = simulate(m, a);
  const auto w = analyzer::what_if(run, analyzer::recorded_config(run));
  CHECK(w.uncertain_steps.empty());
  CHECK(w.estimate.skipped == truth.skipped);
  CHECK(w.optimistic.skipped == truth.skipped);
  CHECK(w.pessimistic.skipped == truth.skipped);
  CHECK(w.estimate.scales == truth.scales);
}

TEST_CASE("another configuration is predicted as the same magnitudes would run under it", "[whatif]") {
  TempDir dir;
  const auto m = magnitudes(120, 30.0);
  const auto run = record(dir.file("a.db"), m, config(65536, 10));
  for (const ScalerConfig& b : {config(1024, 10), config(256, 4), config(4096, 50, 0.25), config(65536, 2)}) {
    INFO(b.describe());
    const auto truth = simulate(m, b);
    const auto w = analyzer::what_if(run, b);
    CHECK(std::abs(w.estimate.skipped - truth.skipped) <= 1);
    CHECK(w.optimistic.skipped <= truth.skipped);
    CHECK(w.pessimistic.skipped >= truth.skipped);
  }
}

TEST_CASE("a step that overflowed when recorded is only bounded below", "[whatif]") {
  TempDir dir;
  // Step 2 overflowed at 4096: its magnitude is only known to exceed 65504 / 4096 = 16.
  const std::vector<double> m = {10, 10, 40, 10, 10};
  const auto run = record(dir.file("a.db"), m, config(4096, 1000));
  SECTION("at the recorded scale or above it overflows for certain") {
    const auto w = analyzer::what_if(run, config(8192, 1000));
    CHECK(w.uncertain_steps.empty());
    CHECK(w.estimate.skips[2]);
  }
  SECTION("below it the recording cannot tell, and says which step") {
    const auto w = analyzer::what_if(run, config(2048, 1000));
    CHECK(w.censored == 1);
    CHECK(w.uncertain_steps == std::vector<std::int64_t>{2});
    CHECK_FALSE(w.optimistic.skips[2]);
    CHECK(w.pessimistic.skips[2]);
    // The estimate takes the smallest overflow consistent with the record (just above 16),
    // which 2048 does not reach (16 * 2048 = 32768).
    CHECK_FALSE(w.estimate.skips[2]);
  }
}

TEST_CASE("steps without statistics are finite below their recorded scale and unknown above", "[whatif]") {
  TempDir dir;
  const auto m = magnitudes(40, 30.0);
  const auto run = record(dir.file("a.db"), m, config(1024, 1000), /*every=*/4);
  const auto lower = analyzer::what_if(run, config(512, 1000));
  CHECK(lower.uncertain_steps.empty());
  CHECK(lower.estimate.skipped == simulate(m, config(512, 1000)).skipped);
  const auto higher = analyzer::what_if(run, config(4096, 1000));
  CHECK(higher.unrecorded > 0);
  CHECK(higher.optimistic.skipped <= higher.pessimistic.skipped);
}

TEST_CASE("what_if refuses a run without a scaler and a malformed configuration", "[whatif]") {
  TempDir dir;
  auto run = record(dir.file("a.db"), magnitudes(10, 1.0), config(1024, 10));
  CHECK_THROWS_AS(analyzer::what_if(run, config(0, 10)), std::invalid_argument);
  CHECK_THROWS_AS(analyzer::what_if(run, config(1024, 0)), std::invalid_argument);
  CHECK_THROWS_AS(analyzer::what_if(run, config(1024, 10, 1.5)), std::invalid_argument);
  run.meta["scaler_enabled"] = "0";
  CHECK_THROWS_WITH(analyzer::what_if(run, config(1024, 10)), Catch::Contains("no loss scaler"));
}

TEST_CASE("the search recommends the configuration with the fewest predicted skips", "[whatif]") {
  TempDir dir;
  const auto m = magnitudes(200, 30.0);
  const auto run = record(dir.file("a.db"), m, config(65536, 2000));
  const auto ranked = analyzer::search_configs(run);
  REQUIRE(ranked.size() > 1);
  for (std::size_t i = 1; i < ranked.size(); ++i) CHECK(ranked[0].estimate.skipped <= ranked[i].estimate.skipped);
  CHECK(ranked[0].estimate.skipped < analyzer::what_if(run, analyzer::recorded_config(run)).estimate.skipped);
}

TEST_CASE("the GUI's what-if lines give the recorded skips and the search's best configuration", "[whatif]") {
  // Recorded at 2048, where the gradients fit but a spike later overflows: a lower scale saves it.
  TempDir dir;
  auto run = record(dir.file("a.db"), magnitudes(200, 30.0), config(2048, 2000));
  std::int64_t skipped = 0;
  for (const auto& s : run.steps) skipped += s.row.skipped ? 1 : 0;
  const auto best = analyzer::search_configs(run).front();
  const auto lines = analyzer::whatif_lines(run);
  REQUIRE(lines.size() == 3);
  CHECK_THAT(lines[0], Catch::EndsWith(": " + std::to_string(skipped) + " skipped"));
  CHECK_THAT(lines[1], Catch::Contains(best.config.describe() + ": " + std::to_string(best.estimate.skipped) + " skips"));
  CHECK(lines[2] == analyzer::grad_scaler_call(run, best.config));
  run.meta["scaler_enabled"] = "0";
  CHECK(analyzer::whatif_lines(run).empty());  // bf16 without a scaler: nothing to replay
}

TEST_CASE("a configuration that saves only the calibration's skips is not recommended", "[whatif]") {
  // From 65536 the scale halves five times before the gradients fit, once: a lower
  // init_scale avoids those skips and nothing after them.
  TempDir dir;
  const auto run = record(dir.file("a.db"), std::vector<double>(200, 30.0), config(65536, 2000));
  const auto recorded = analyzer::what_if(run, analyzer::recorded_config(run));
  REQUIRE(recorded.estimate.skipped == 5);
  CHECK(recorded.estimate.calibration == 5);
  const auto best = analyzer::search_configs(run).front();
  CHECK_FALSE(analyzer::improves_on(best, recorded));
  CHECK_THAT(analyzer::recommendation(run, best, recorded, 24), Catch::StartsWith("keep the recorded configuration"));
}

TEST_CASE("a short run's one back-off after a step that fit counts as calibration, as in the report", "[whatif]") {
  // Step 0 fits at 65536, step 1's larger gradients do not; the run ends at 32768 before
  // the scale has held 5 steps: the descent from init_scale, not a reason to change it.
  TempDir dir;
  const auto run = record(dir.file("a.db"), {0.5, 1.5, 0.5, 0.5, 0.5}, config(65536, 2000));
  const auto recorded = analyzer::what_if(run, analyzer::recorded_config(run));
  REQUIRE(recorded.estimate.skipped == 1);
  CHECK(recorded.estimate.calibration == 1);
  CHECK_FALSE(analyzer::improves_on(analyzer::search_configs(run).front(), recorded));
}

TEST_CASE("a run whose every skip had NaN/Inf in forward is told to keep its scaler", "[whatif]") {
  // No scale avoids those skips, so every configuration of the grid skips as many; the one
  // with the highest lowest scale used to be recommended as if it did better.
  TempDir dir;
  {
    RunFixture f(dir.file("a.db"), {"w"});
    f.meta("scaler_init_scale", "65536").meta("scaler_growth_interval", "2000");
    double scale = 65536;
    for (int t = 0; t < 40; ++t) {
      if (t % 10 == 5) {
        f.step(scale, scale / 2, 1.0, {"w"}, std::nan(""));
        scale /= 2;
      } else {
        f.step(scale, scale, 0.01 * scale);
      }
    }
    f.finish();
  }
  const auto run = analyzer::load_run(dir.file("a.db"));
  const auto recorded = analyzer::what_if(run, analyzer::recorded_config(run));
  const auto grid = analyzer::search_configs(run);
  REQUIRE(recorded.always_skipped == 4);
  CHECK(grid.front().estimate.skipped == recorded.estimate.skipped);
  CHECK_FALSE(analyzer::improves_on(grid.front(), recorded));
  const std::string advice = analyzer::recommendation(run, grid.front(), recorded, grid.size());
  CHECK_THAT(advice, Catch::StartsWith("keep the recorded configuration"));
  CHECK_THAT(advice, Catch::Contains("4 of its 4 skips were NaN/Inf whatever the scale"));
  CHECK(analyzer::whatif_lines(run).back() == advice);
}

TEST_CASE("skips made by the loss's backward are skipped at any scale, not counted as overflows", "[whatif]") {
  // Their forward was finite: only the gradient reaching the model's output says no scale avoids them.
  TempDir dir;
  {
    RunFixture f(dir.file("a.db"), {"w"});
    double scale = 65536;
    for (int t = 0; t < 8; ++t, scale /= 2)
      f.event("output-gradient-nonfinite", "float32 [4, 4]: 16 NaN, 0 Inf of 16 values").step(scale, scale / 2, 1.0, {"w"});
    f.finish();
  }
  const auto run = analyzer::load_run(dir.file("a.db"));
  const auto recorded = analyzer::what_if(run, analyzer::recorded_config(run));
  CHECK(recorded.always_skipped == 8);
  CHECK(recorded.censored == 0);
}

TEST_CASE("a gradient penalty's NaN/Inf loss above a scale of 1 is an overflow a lower scale avoids", "[whatif]") {
  // The loss is built from the scaled loss's gradients: it overflows with them.
  TempDir dir;
  {
    RunFixture f(dir.file("a.db"), {"w"});
    f.event("scaled-gradients-in-loss", "a backward with create_graph=True from scaler.scale()'s output");
    double scale = 65536;
    for (int t = 0; t < 3; ++t, scale /= 2) f.step(scale, scale / 2, 1.0, {"w"}, std::nan(""));
    for (int t = 0; t < 5; ++t) f.step(scale, scale, 0.01 * scale);
    f.finish();
  }
  const auto run = analyzer::load_run(dir.file("a.db"));
  const auto recorded = analyzer::what_if(run, analyzer::recorded_config(run));
  CHECK(recorded.always_skipped == 0);
  CHECK(recorded.censored == 3);
}

TEST_CASE("with histograms the share of values a lower scale flushes to zero is predicted", "[whatif]") {
  TempDir dir;
  const auto path = dir.file("a.db");
  // Recorded at 1024 throughout: per row, 100 values at the abs-max (30 * 1024) and the rest
  // (3996) at 1e-3, the fixture's smallest non-zero value.
  const std::vector<double> m(10, 30.0);
  const auto run = record(path, m, config(1024, 1000), 1, /*histograms=*/true);
  const auto histograms = analyzer::read_step_histograms(path);
  REQUIRE(histograms.size() == m.size());
  // The same values, computed directly: v * s / 1024 below 2^-25 rounds to zero in fp16.
  const auto expected = [](double s) {
    double flushed = 0;
    for (const auto& [value, count] : {std::pair{30.0 * 1024, 100.0}, std::pair{1e-3, 3996.0}})
      if (value * s / 1024 < std::ldexp(1.0, -25)) flushed += count;
    return flushed / 4096;
  };
  for (double s : {1024.0, 32.0, std::ldexp(1.0, -10), std::ldexp(1.0, -30)}) {
    INFO("scale " << s);
    const auto w = analyzer::what_if(run, config(s, 1000), &histograms);
    CHECK(w.underflow == Approx(expected(s)));
  }
  CHECK(analyzer::what_if(run, config(1024, 1000)).underflow == -1.0);  // no histograms given
}

TEST_CASE("a run whose loss diverged is told to keep its scaler, whatever the replay predicts", "[whatif]") {
  // The loss grew 30000x while finite, then every step overflowed: censored overflows that
  // a far lower scale is predicted to pass. The loop is the fix, not the scaler.
  TempDir dir;
  {
    RunFixture f(dir.file("a.db"), {"w"});
    for (double loss : {2.0, 2.1, 1.9, 2.0, 2.2, 30.0, 400.0, 5000.0, 60000.0}) f.step(65536, 65536, 1000, {}, loss);
    double scale = 65536;
    for (int i = 0; i < 12; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"w"}, 1e6);
    f.finish();
  }
  const auto run = analyzer::load_run(dir.file("a.db"));
  const auto recorded = analyzer::what_if(run, analyzer::recorded_config(run));
  const auto grid = analyzer::search_configs(run);
  CHECK_FALSE(analyzer::recommends(run, grid.front(), recorded));
  CHECK_THAT(analyzer::recommendation(run, grid.front(), recorded, grid.size()),
             Catch::StartsWith("keep the recorded configuration: the loss diverged"));
}
