// The weight_norms table: rows round-trip in step and layer order, files written before it
// read as "none sampled", and values no parameter has are refused on both sides.
#include <catch2/catch.hpp>

#include <cmath>
#include <stdexcept>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "run_sql.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::run_sql;
using ampdiag::test::TempDir;

TEST_CASE("weight_norms rows read back in step and layer order", "[rundb][weight-norms]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.add_weight_norm({9, 1, 103.7, 2.45});
    w.add_weight_norm({0, 1, 1.81, 0.085});
    w.add_weight_norm({0, 0, 0.0, 0.0});
    w.finish();
  }
  const auto rows = RunDbReader(path).weight_norms();
  REQUIRE(rows.size() == 3);
  CHECK((rows[0].step == 0 && rows[0].layer_id == 0 && rows[0].l2 == 0.0));
  CHECK((rows[1].step == 0 && rows[1].layer_id == 1 && rows[1].l2 == 1.81 && rows[1].absmax == 0.085));
  CHECK((rows[2].step == 9 && rows[2].l2 == 103.7));
}

TEST_CASE("the writer refuses norms no parameter has", "[rundb][weight-norms]") {
  TempDir dir;
  RunDbWriter w(dir.file("run.db"), false);
  REQUIRE_THROWS_AS(w.add_weight_norm({0, 0, 1.0, 2.0}), std::invalid_argument);  // abs-max above the L2 norm
  REQUIRE_THROWS_AS(w.add_weight_norm({0, 0, -1.0, 0.0}), std::invalid_argument);
  REQUIRE_THROWS_AS(w.add_weight_norm({0, 0, std::nan(""), 0.0}), std::invalid_argument);
  REQUIRE_THROWS_AS(w.add_weight_norm({0, -1, 1.0, 0.5}), std::invalid_argument);
}

TEST_CASE("a run.db written before weight norms existed has none", "[rundb][weight-norms]") {
  TempDir dir;
  const auto path = dir.file("old.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "DROP TABLE weight_norms;");
  CHECK(RunDbReader(path).weight_norms().empty());
}

TEST_CASE("a weight norm whose abs-max exceeds its L2 norm is reported as corruption", "[rundb][weight-norms]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "INSERT INTO weight_norms VALUES (4, 2, 1.0, 7.0);");
  REQUIRE_THROWS_WITH(RunDbReader(path).weight_norms(), Catch::Contains("weight_norms") && Catch::Contains("layer 2"));
}
