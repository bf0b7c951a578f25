// Ranks that hold different shards of a layer (FSDP1's plain-tensor shards, a one-element
// bias on one rank and none on the other), and the skipped-steps lines of a rank whose own
// gradients were finite in a skip every rank took together.
#include "rule_test.h"

namespace {

const std::vector<std::string> kShardLayers = {"0.weight", "2.weight", "4.bias"};

// Two ranks of 10 steps; rank 1 alone holds 4.bias (`rank0_bias` values of it on rank 0)
// and its gradient overflows at steps 3 and 4, which rank 0 skips too with every gradient
// finite, unless `rank0_rows` is false (then it has no gradient rows at those steps).
std::vector<Run> shared_skips(const TempDir& dir, std::int64_t rank0_bias = 0, bool rank0_rows = true) {
  {
    RunFixture r0(dir.file("run.rank0.db"), kShardLayers, 0, 2, "float32", {}, {{"4.bias", {rank0_bias}}});
    RunFixture r1(dir.file("run.rank1.db"), kShardLayers, 1, 2, "float32", {}, {{"4.bias", {1}}});
    for (int i = 0; i < 10; ++i) {
      const bool overflow = i == 3 || i == 4;
      const double after = overflow ? 32768 : 65536;
      if (overflow) r0.skipped_for_another_rank();
      const std::vector<std::string> rows = overflow && !rank0_rows ? std::vector<std::string>{"none"}  // no such layer
                                                                    : std::vector<std::string>{};
      r0.step(65536, after, 1000, {}, 0.5, rows);
      r1.step(65536, after, 1000, overflow ? std::vector<std::string>{"4.bias"} : std::vector<std::string>{});
    }
    r0.finish();
    r1.finish();
  }
  std::vector<Run> runs;
  runs.push_back(load_run(dir.file("run.rank0.db")));
  runs.push_back(load_run(dir.file("run.rank1.db")));
  return runs;
}

}  // namespace

TEST_CASE("a layer the ranks hold different numbers of values of is not compared between them",
          "[rules][ranks][shards]") {
  TempDir dir;
  const Report r = analyze(shared_skips(dir));
  CHECK(find(r, "rank-disagreement") == nullptr);
}

TEST_CASE("a layer the ranks hold alike is still compared between them", "[rules][ranks][shards]") {
  TempDir dir;
  const Report r = analyze(shared_skips(dir, 1));
  const Finding& d = required(r, "rank-disagreement");
  CHECK(d.layer == "4.bias");
  CHECK(d.ranks == std::vector<std::int64_t>{1});
}

TEST_CASE("a rank whose own gradients stayed finite in a skip names the rank whose did not", "[rules][ranks][shards]") {
  TempDir dir;
  const Report r = analyze(shared_skips(dir));
  CHECK_THAT(render_text(r, Gate("error")),
             Catch::Contains("rank 0 step 3 (scale 65536): every gradient recorded on this rank was finite; rank 1's "
                             "held NaN/Inf (4.bias), and the ranks' scalers skip together"));
  CHECK_THAT(render_json(r, Gate("error")), Catch::Contains("\"gradients_recorded\": true, \"nonfinite_rank\": 1"));
}

TEST_CASE("a skipped step without gradient rows says none were recorded", "[rules][ranks][shards]") {
  TempDir dir;
  const Report r = analyze(shared_skips(dir, 0, false));
  CHECK_THAT(render_text(r, Gate("error")),
             Catch::Contains("rank 0 step 3 (scale 65536): no gradient statistics recorded for this step"));
  CHECK_THAT(render_json(r, Gate("error")), Catch::Contains("\"gradients_recorded\": false, \"nonfinite_rank\": null"));
}
