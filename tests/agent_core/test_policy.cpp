// The agent's pure decisions: which steps to record, when to read the weights, which file a
// rank writes.
#include <catch2/catch.hpp>

#include <vector>

#include "run_paths.h"
#include "sampling.h"
#include "weight_schedule.h"

using namespace ampdiag::agent;

TEST_CASE("every N-th step is recorded when nothing happens", "[policy]") {
  SamplingPolicy p(5, 2);
  for (int step = 0; step < 20; ++step) CHECK(p.decide(step, false, false).record == (step % 5 == 0));
}

TEST_CASE("an overflow is recorded with the steps around it", "[policy]") {
  SamplingPolicy p(100, 2);
  CHECK_FALSE(p.decide(1, false, false).record);
  const auto d = p.decide(2, true, true);
  CHECK(d.record);
  CHECK(d.flush_before == 2);
  CHECK(p.decide(3, false, false).record);
  CHECK(p.decide(4, false, false).record);
  CHECK_FALSE(p.decide(5, false, false).record);
}

TEST_CASE("a scale change alone is recorded too", "[policy]") {
  SamplingPolicy p(100, 0);
  CHECK(p.decide(7, false, true).record);
  CHECK_FALSE(p.decide(8, false, false).record);
}

TEST_CASE("sampling options out of range are refused", "[policy]") {
  CHECK_THROWS_AS(SamplingPolicy(0, 1), std::invalid_argument);
  CHECK_THROWS_AS(SamplingPolicy(1, -1), std::invalid_argument);
}

TEST_CASE("the weights are read twice a doubling up to step 256, then every 64th step", "[policy]") {
  std::vector<std::int64_t> due;
  for (std::int64_t step = 0; step < 300; ++step)
    if (WeightSchedule::due(step)) due.push_back(step);
  CHECK(due == std::vector<std::int64_t>{0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256});
  CHECK(WeightSchedule::due(320));
  CHECK_FALSE(WeightSchedule::due(321));
}

TEST_CASE("a step's weights are read once, however many optimizers step", "[policy]") {
  WeightSchedule s;
  CHECK(s.at_start(2));
  CHECK_FALSE(s.at_start(2));
  CHECK_FALSE(s.after_skip(2));  // a skipped step on the schedule was read as it began
  CHECK_FALSE(s.at_start(5));    // off the schedule
}

TEST_CASE("only the run's first skipped steps are read off the schedule", "[policy]") {
  WeightSchedule s;
  int read = 0;
  for (std::int64_t step = 5; step < 5 + 2 * WeightSchedule::kSkipped; step += 2) read += s.after_skip(step);
  CHECK(read == WeightSchedule::kSkipped);
  CHECK_FALSE(s.after_skip(1001));
}

TEST_CASE("rank file names keep the directory and extension", "[policy]") {
  CHECK(rank_db_path("run.db", {0, 1}) == "run.db");
  CHECK(rank_db_path("run.db", {3, 8}) == "run.rank3.db");
  CHECK(rank_db_path("out.v2/run", {1, 2}) == "out.v2/run.rank1.db");
  CHECK(rank_db_path("/tmp/x.sqlite", {0, 2}) == "/tmp/x.rank0.sqlite");
}
