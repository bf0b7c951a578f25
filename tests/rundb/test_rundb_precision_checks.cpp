// The precision_checks table: rows round-trip in the order made, files written before it
// read as "no checks", and values no comparison gives are refused on both sides.
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

TEST_CASE("precision_checks rows read back in the order they were made", "[rundb][precision]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.add_precision_check({3, "norm", "float32", 2048, 0.997, 2040, 3.7});
    w.add_precision_check({1, "inp", "float16", 4096, 0.0004, 0, 812.5});
    w.finish();
  }
  const auto rows = RunDbReader(path).precision_checks();
  REQUIRE(rows.size() == 2);
  CHECK((rows[0].step == 3 && rows[0].module == "norm" && rows[0].dtype == "float32" && rows[0].numel == 2048));
  CHECK((rows[0].rel_error == 0.997 && rows[0].zeroed == 2040 && rows[0].fp32_absmax == 3.7));
  CHECK((rows[1].step == 1 && rows[1].module == "inp" && rows[1].zeroed == 0));
}

TEST_CASE("the writer refuses a precision check no comparison gives", "[rundb][precision]") {
  TempDir dir;
  RunDbWriter w(dir.file("run.db"), false);
  REQUIRE_THROWS_AS(w.add_precision_check({0, "m", "float16", 0, 0.1, 0, 1.0}), std::invalid_argument);
  REQUIRE_THROWS_AS(w.add_precision_check({0, "m", "float16", 8, 0.1, 9, 1.0}), std::invalid_argument);
  REQUIRE_THROWS_AS(w.add_precision_check({0, "m", "float16", 8, std::nan(""), 0, 1.0}), std::invalid_argument);
  REQUIRE_THROWS_AS(w.add_precision_check({0, "m", "float16", 8, 0.1, 0, 0.0}), std::invalid_argument);
}

TEST_CASE("a run.db written before precision checks existed has none", "[rundb][precision]") {
  TempDir dir;
  const auto path = dir.file("old.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "DROP TABLE precision_checks;");
  CHECK(RunDbReader(path).precision_checks().empty());
}

TEST_CASE("a precision check with more zeroed values than compared ones is reported as corruption",
          "[rundb][precision]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "INSERT INTO precision_checks (step, module, dtype, numel, rel_error, zeroed, fp32_absmax) "
                "VALUES (2, 'norm', 'float16', 5, 0.5, 9, 1.0);");
  REQUIRE_THROWS_WITH(RunDbReader(path).precision_checks(),
                      Catch::Contains("precision_checks") && Catch::Contains("norm at step 2"));
}

TEST_CASE("a precision check whose count is text is reported as corruption", "[rundb][precision]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "INSERT INTO precision_checks (step, module, dtype, numel, rel_error, zeroed, fp32_absmax) "
                "VALUES (2, 'norm', 'float16', 'many', 0.5, 1, 1.0);");
  REQUIRE_THROWS_WITH(RunDbReader(path).precision_checks(), Catch::Contains("not an integer"));
}
