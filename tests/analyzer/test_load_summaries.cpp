// load_run reads the writer's per-step summaries (grad_samples, grad_hist_sums) instead
// of every grad_stats row; what it builds from them must be the Run a full scan builds,
// for finished runs, runs still being written, and the ways a writer can be driven.
#include <catch2/catch.hpp>
#include <cstring>
#include <random>

#include "../rundb/temp_dir.h"
#include "random_run.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/writer.h"

using namespace ampdiag;
using ampdiag::test::RandomRun;
using ampdiag::test::exec_sql;
using ampdiag::test::load_partial;
using ampdiag::test::TempDir;
using ampdiag::test::require_same_run;

namespace {

// A finished RandomRun of `layers` layers and `steps` steps, at dir/run.db.
std::string finished_run(const TempDir& dir, int layers, std::int64_t steps) {
  const std::string path = dir.file("run.db");
  RandomRun run(path, layers);
  run.steps(0, steps);
  run.writer().finish();
  return path;
}

}  // namespace

TEST_CASE("a finished run read from its summaries is the run a full scan reads", "[load][summaries]") {
  TempDir dir;
  // 80,000 histogram rows: the writer writes their sums more than once.
  const std::string path = finished_run(dir, 200, 400);
  const auto scan = load_partial(path, true);
  REQUIRE(scan.grad_rows == 80000);
  require_same_run(load_partial(path, false), scan);
}

TEST_CASE("a run still being written reads the same from its summaries as by a full scan", "[load][summaries]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  RandomRun run(path, 200);
  run.steps(0, 450);
  run.writer().commit();
  // Some histogram sums are written, the rows after them are not summed yet.
  require_same_run(load_partial(path, false), load_partial(path, true));
}

TEST_CASE("summaries stay true after a transaction is rolled back", "[load][summaries]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  {
    RandomRun run(path, 200);
    run.steps(0, 350);
    run.writer().commit();
    run.steps(350, 3);
    run.writer().rollback();  // as the agent does after a failed commit: those rows are lost
    run.steps(353, 100);
    run.writer().finish();
  }
  require_same_run(load_partial(path, false), load_partial(path, true));
}

TEST_CASE("a step written after a later one takes its place in step order", "[load][summaries]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  {
    RandomRun run(path, 4);
    run.steps(0, 5);
    run.writer().commit();
    run.step(6);
    run.writer().commit();
    run.step(5);
    run.writer().finish();
  }
  const auto summaries = load_partial(path, false);
  for (const auto& layer : summaries.layers) {
    REQUIRE(layer.samples.size() == 7);
    for (std::size_t i = 0; i < 7; ++i) CHECK(layer.samples[i].step == std::int32_t(i));
  }
  require_same_run(summaries, load_partial(path, true));
}

TEST_CASE("a run written before the summaries existed is read by scanning grad_stats", "[load][summaries]") {
  TempDir dir;
  const std::string path = finished_run(dir, 20, 50);
  const auto expected = load_partial(path, true);
  exec_sql(path, "DROP TABLE grad_samples; DROP TABLE grad_hist_sums;");
  require_same_run(load_partial(path, false), expected);
}

TEST_CASE("a summary that is not a whole number of records is a corrupt run.db", "[load][summaries]") {
  TempDir dir;
  const std::string path = finished_run(dir, 3, 5);
  exec_sql(path, "UPDATE grad_samples SET samples = substr(samples, 1, 19) WHERE id = 2;");
  CHECK_THROWS_WITH(load_partial(path, false), Catch::Contains("corrupt run.db") && Catch::Contains("grad_samples") &&
                                           Catch::Contains("whole number of 20-byte records"));
}

TEST_CASE("a summary naming a layer the layers table lacks is a corrupt run.db", "[load][summaries]") {
  TempDir dir;
  const std::string path = finished_run(dir, 3, 5);
  // The first record's layer id (its first 4 bytes, little-endian) becomes 9.
  exec_sql(path, "UPDATE grad_samples SET samples = CAST(x'09000000' || substr(samples, 5) AS BLOB) WHERE id = 1;");
  CHECK_THROWS_WITH(load_partial(path, false), Catch::Contains("corrupt run.db") && Catch::Contains("grad_samples has a row for layer 9"));
}

TEST_CASE("the writer refuses a gradient row whose layer id no run.db can hold", "[load][summaries]") {
  TempDir dir;
  rundb::RunDbWriter w(dir.file("run.db"), true);
  rundb::GradStatRow g;
  g.layer_id = -1;
  CHECK_THROWS_WITH(w.add_grad_stat(g), Catch::Contains("layer id -1"));
  g.layer_id = std::int64_t(1) << 33;
  CHECK_THROWS_WITH(w.add_grad_stat(g), Catch::Contains("layer ids run from 0 to 2^32-1"));
}
