// The stalled-update table: rows round-trip, older formats read as "no rows", and counts
// no measurement gives are refused on both sides.
#include <catch2/catch.hpp>

#include <stdexcept>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "run_sql.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::run_sql;
using ampdiag::test::TempDir;

TEST_CASE("weight_updates rows read back in step and layer order", "[rundb][weights]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.add_weight_update({5, 1, 100, 97});
    w.add_weight_update({5, 0, 40, 0});
    w.add_weight_update({0, 1, 100, 3});
    w.finish();
  }
  const auto rows = RunDbReader(path).weight_updates();
  REQUIRE(rows.size() == 3);
  CHECK((rows[0].step == 0 && rows[0].layer_id == 1 && rows[0].stalled == 3));
  CHECK((rows[1].step == 5 && rows[1].layer_id == 0 && rows[1].nonzero == 40 && rows[1].stalled == 0));
  CHECK((rows[2].step == 5 && rows[2].layer_id == 1 && rows[2].nonzero == 100 && rows[2].stalled == 97));
}

TEST_CASE("the writer refuses more stalled elements than measured ones", "[rundb][weights]") {
  TempDir dir;
  RunDbWriter w(dir.file("run.db"), false);
  REQUIRE_THROWS_AS(w.add_weight_update({0, 0, 3, 4}), std::invalid_argument);
  REQUIRE_THROWS_AS(w.add_weight_update({0, 0, -1, 0}), std::invalid_argument);
}

TEST_CASE("a run.db written before format 4 has no weight_updates rows", "[rundb][weights]") {
  TempDir dir;
  const auto path = dir.file("v3.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "DROP TABLE weight_updates; UPDATE meta SET value = '3' WHERE key = 'schema_version';");
  RunDbReader r(path);
  CHECK(r.schema_version() == 3);
  CHECK(r.weight_updates().empty());
}

TEST_CASE("a format 4 run.db without weight_updates is refused as incomplete", "[rundb][weights]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "DROP TABLE weight_updates;");
  REQUIRE_THROWS_WITH(RunDbReader(path), Catch::Contains("no table weight_updates"));
}

TEST_CASE("a weight_updates row with more stalled than measured elements is reported as corruption",
          "[rundb][weights]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "INSERT INTO weight_updates VALUES (2, 0, 5, 9);");
  REQUIRE_THROWS_WITH(RunDbReader(path).weight_updates(),
                      Catch::Contains("weight_updates") && Catch::Contains("9 of 5"));
}
