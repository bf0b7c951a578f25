// The SQLite layer's work bound: the last line of defence against a file that makes a
// query run forever (a view the table checks missed, a damaged b-tree).
#include <catch2/catch.hpp>

#include "ampdiag/rundb/rows.h"
#include "sqlite.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::TempDir;

namespace {
constexpr const char* kEndless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c";
}

TEST_CASE("a bounded connection interrupts an endless query and names the table", "[rundb]") {
  TempDir dir;
  { Database create(dir.file("any.db"), Database::Mode::kCreate); }
  Database db(dir.file("any.db"), Database::Mode::kReadOnly);
  db.bound_work(1000000);
  Statement q(db, kEndless, "table steps");
  REQUIRE_THROWS_WITH(q.next(), Catch::Contains("reading table steps") && Catch::Contains("far more work"));
  REQUIRE(db.work_exhausted());
}

TEST_CASE("a bounded connection lets a query within the bound finish", "[rundb]") {
  TempDir dir;
  { Database create(dir.file("any.db"), Database::Mode::kCreate); }
  Database db(dir.file("any.db"), Database::Mode::kReadOnly);
  db.bound_work(100000000);
  Statement q(db, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000) SELECT count(*) FROM c",
              "table steps");
  REQUIRE(q.next());
  REQUIRE(q.int64(0) == 1000);
  REQUIRE_FALSE(db.work_exhausted());
}
