// load_run keeps the statistics the views show besides abs-max: L2 per sample, each
// layer's smallest non-zero magnitude and its summed exponent histogram.
#include <catch2/catch.hpp>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/writer.h"

using namespace ampdiag;
using ampdiag::test::TempDir;

namespace {

// Three steps of one layer: step 0 finite, step 1 finite with smaller values, step 2 NaN
// with a tiny amin_nz that must not count.
std::string write_run(const TempDir& dir, bool histograms) {
  const std::string path = dir.file("run.db");
  rundb::RunDbWriter w(path, true);
  w.set_meta("histogram", histograms ? "1" : "0");
  w.add_layer({0, "fc.weight", "fc", "Linear", "float32", "[4, 4]", 16, true, ""});
  const double amin[] = {1e-3, 2e-6, 1e-12};
  const double l2[] = {4.0, 8.0, 0.0};
  for (int step = 0; step < 3; ++step) {
    rundb::StepRow s;
    s.step = step;
    s.losses = 1;
    s.scale_before = s.scale_after = 1024.0;
    s.skipped = s.found_inf = step == 2;
    w.add_step(s);
    rundb::GradStatRow g;
    g.step = step;
    g.layer_id = 0;
    g.bwd_order = 0;
    g.stats = {16, step == 2 ? 1 : 0, 0, 0, 0, 10.0, amin[step], l2[step]};
    g.histogram.assign(rundb::kHistBins, 0);
    g.histogram[std::size_t(step + 10)] = 3;
    g.histogram[40] = 5;
    w.add_grad_stat(g);
  }
  w.finish();
  return path;
}

}  // namespace

TEST_CASE("a layer's smallest non-zero magnitude is the least over its finite samples", "[load]") {
  TempDir dir;
  const auto run = analyzer::load_run(write_run(dir, false));
  CHECK(run.layers[0].least_nonzero == Approx(2e-6));
  CHECK(run.layers[0].least_nonzero_step == 1);
}

TEST_CASE("every sample keeps its L2 norm as stored", "[load]") {
  TempDir dir;
  const auto run = analyzer::load_run(write_run(dir, false));
  REQUIRE(run.layers[0].samples.size() == 3);
  CHECK(run.layers[0].samples[0].l2 == 4.0f);
  CHECK(run.layers[0].samples[1].l2 == 8.0f);
}

TEST_CASE("histograms are summed over the finite samples when the agent recorded them", "[load]") {
  TempDir dir;
  const auto run = analyzer::load_run(write_run(dir, true));
  const auto& h = run.layers[0].histogram;
  REQUIRE(h.size() == std::size_t(rundb::kHistBins));
  CHECK(h[10] == 3);
  CHECK(h[11] == 3);
  CHECK(h[12] == 0);  // the NaN step's histogram is left out
  CHECK(h[40] == 10);
}

TEST_CASE("no histogram is loaded from a run whose agent did not record them", "[load]") {
  TempDir dir;
  CHECK(analyzer::load_run(write_run(dir, false)).layers[0].histogram.empty());
}
