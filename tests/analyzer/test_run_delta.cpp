// Following a run.db while it is written: a Run that reads on from its cursor after each
// commit holds what load_run reads from the file at that point, and a file that cannot be
// read on from the cursor says so instead of giving a wrong Run.
#include <cmath>
#include <functional>

#include <catch2/catch.hpp>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/run_delta.h"
#include "random_run.h"

using namespace ampdiag;
using ampdiag::test::RandomRun;
using ampdiag::test::exec_sql;
using ampdiag::test::load_partial;
using ampdiag::test::TempDir;
using ampdiag::test::require_same_run;

namespace {

// Reads on from the run's cursor; false when the file asked to be read whole again.
bool follow(analyzer::Run& run) {
  analyzer::RunDelta d = analyzer::read_run_delta(run.path, run.cursor);
  if (d.reload) return false;
  analyzer::apply_run_delta(run, std::move(d));
  return true;
}

// A random run's first three steps committed, and a Run read from them to follow it.
struct Followed {
  TempDir dir;
  const std::string path = dir.file("run.db");
  RandomRun run;
  analyzer::Run followed;
  Followed(int layers, int modules) : run(path, layers, modules) {
    run.steps(0, 3);
    run.writer().commit();
    followed = load_partial(path);
  }
};

// Step 3's forward: act_stats rows 0 to `total` - 1, each `fill`ed, committed in two parts
// split at `split` (the second also ending the step), `f.followed` reading on after each.
// Returns what a whole load reads then.
analyzer::Run split_forward(Followed& f, std::int64_t split, std::int64_t total,
                            const std::function<void(rundb::ActStatRow&)>& fill) {
  const auto forward = [&](std::int64_t from, std::int64_t to) {
    for (std::int64_t i = from; i < to; ++i) {
      rundb::ActStatRow a;
      a.step = 3;
      a.fwd_order = i;
      fill(a);
      f.run.writer().add_act_stat(a);
    }
    f.run.writer().commit();
  };
  forward(0, split);
  REQUIRE(follow(f.followed));
  forward(split, total);
  f.run.unsampled_step(3);
  f.run.writer().commit();
  REQUIRE(follow(f.followed));
  return load_partial(f.path);
}

}  // namespace

TEST_CASE("a run followed commit by commit holds what a whole load reads", "[load][delta]") {
  Followed f(60, 12);
  auto& [dir, path, run, followed] = f;
  // Read on after every step: some reads see a step half committed (RandomRun commits in
  // the middle of steps), and over 1,200 x 60 rows the writer sums histograms more than once.
  for (std::int64_t s = 3; s < 1200; ++s) {
    run.step(s);
    REQUIRE(follow(followed));
    if (s % 300 == 0) require_same_run(followed, load_partial(path));
  }
  run.writer().finish();
  REQUIRE(follow(followed));
  CHECK(followed.finished);
  require_same_run(followed, load_partial(path));
}

TEST_CASE("steps the agent records late, before an overflow, reach a followed run", "[load][delta]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  RandomRun run(path, 8, 3);
  run.steps(0, 2);
  for (std::int64_t s = 2; s < 40; ++s) run.unsampled_step(s);
  run.writer().commit();
  auto followed = load_partial(path);
  REQUIRE(followed.steps.size() == 40);
  // The agent writes the steps before an overflow after all: their rows again, sampled now.
  run.steps(30, 15);
  run.writer().commit();
  REQUIRE(follow(followed));
  const auto whole = load_partial(path);
  REQUIRE(whole.steps.size() == 45);
  CHECK(whole.steps[35].row.sampled);
  require_same_run(followed, whole);
}

TEST_CASE("a steps row written below the cursor asks for a whole read", "[load][delta]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  RandomRun run(path, 4);
  run.steps(0, 3);
  run.steps(5, 2);
  run.writer().commit();
  auto followed = load_partial(path);
  run.unsampled_step(3);  // below step 6, the last one read, and not rewriting a row
  run.writer().commit();
  CHECK_FALSE(follow(followed));
}

TEST_CASE("a file that holds another run now asks for a whole read", "[load][delta]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  analyzer::Run followed;
  {
    RandomRun first(path, 4);
    first.writer().set_meta("run_id", "first");
    first.steps(0, 10);
    first.writer().finish();
    followed = load_partial(path);
  }
  RandomRun second(path, 4);  // overwrites the file
  second.writer().set_meta("run_id", "second");
  second.steps(0, 12);
  second.writer().commit();
  CHECK_FALSE(follow(followed));
}

TEST_CASE("a file without summaries is followed by whole reads", "[load][delta]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  RandomRun run(path, 4);
  run.steps(0, 10);
  run.writer().finish();
  exec_sql(path, "DROP TABLE grad_samples; DROP TABLE grad_hist_sums;");
  auto followed = load_partial(path);
  CHECK_FALSE(followed.cursor.incremental);
  CHECK_FALSE(follow(followed));
}

TEST_CASE("reading on from a cursor with nothing new changes nothing", "[load][delta]") {
  TempDir dir;
  const std::string path = dir.file("run.db");
  RandomRun run(path, 10, 4);
  run.steps(0, 50);
  run.writer().finish();
  auto followed = load_partial(path);
  REQUIRE(follow(followed));
  REQUIRE(follow(followed));
  require_same_run(followed, load_partial(path));
}

TEST_CASE("a delta that asks for a whole read is refused by the merge", "[load][delta]") {
  analyzer::Run run;
  analyzer::RunDelta d;
  d.reload = true;
  CHECK_THROWS_AS(analyzer::apply_run_delta(run, std::move(d)), std::invalid_argument);
}

TEST_CASE("a forward split between two reads keeps each module's place in it", "[load][delta]") {
  // Modules 3, 0, 1, 2 in that order at step 3.
  Followed f(2, 4);
  const auto whole = split_forward(f, 2, 4, [](rundb::ActStatRow& a) {
    a.module_id = (a.fwd_order + 3) % 4;
    a.stats = {4096, 0, 0, 0, 0, 1.0, 0.01, 10.0};
  });
  CHECK(whole.modules[2].position == 3);
  CHECK(whole.modules[2].before_last == 1);
  require_same_run(f.followed, whole);
}

TEST_CASE("a forward split between two reads keeps a module's calls in it", "[load][delta]") {
  // Module 1 called ten times at step 3, its |output| doubling, NaN/Inf at the ninth call.
  Followed f(2, 4);
  const auto whole = split_forward(f, 9, 10, [](rundb::ActStatRow& a) {
    a.module_id = 1;
    a.stats = {4096, a.fwd_order >= 8 ? 2 : 0, 0, 0, 0, std::ldexp(1.0, int(a.fwd_order)), 0.01, 10.0};
  });
  CHECK(whole.modules[1].growth.calls == 10);
  CHECK(whole.modules[1].growth.nonfinite_call == 8);
  CHECK(whole.modules[1].growth.grows());
  require_same_run(f.followed, whole);
}
