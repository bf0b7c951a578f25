// The profiler's table: rows of one key add up, older formats read as "no rows", and
// values no writer writes are refused.
#include <catch2/catch.hpp>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "run_sql.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::run_sql;
using ampdiag::test::TempDir;

TEST_CASE("gpu_time rows of the same step, module, phase and kind add up", "[rundb][gpu]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.add_gpu_time({4, 2, GpuPhase::kForward, GpuKind::kFloat16, 3, 300});
    w.commit();  // records of one step arrive in several buffers, so in several transactions
    w.add_gpu_time({4, 2, GpuPhase::kForward, GpuKind::kFloat16, 1, 50});
    w.add_gpu_time({4, 2, GpuPhase::kBackward, GpuKind::kFloat32, 2, 900});
    w.add_gpu_time({4, -1, GpuPhase::kAmpdiag, GpuKind::kMemcpy, 1, 7});
    w.finish();
  }
  const auto rows = RunDbReader(path).gpu_time();
  REQUIRE(rows.size() == 3);
  CHECK(rows[0].module_id == -1);
  CHECK(rows[0].kind == GpuKind::kMemcpy);
  CHECK((rows[1].phase == GpuPhase::kForward && rows[1].count == 4 && rows[1].ns == 350));
  CHECK((rows[2].phase == GpuPhase::kBackward && rows[2].kind == GpuKind::kFloat32 && rows[2].ns == 900));
}

TEST_CASE("a run.db written before format 3 has no gpu_time rows", "[rundb][gpu]") {
  TempDir dir;
  const auto path = dir.file("v2.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "DROP TABLE gpu_time; UPDATE meta SET value = '2' WHERE key = 'schema_version';");
  RunDbReader r(path);
  CHECK(r.schema_version() == 2);
  CHECK(r.gpu_time().empty());
}

TEST_CASE("a format 3 run.db without gpu_time is refused as incomplete", "[rundb][gpu]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "DROP TABLE gpu_time;");
  REQUIRE_THROWS_WITH(RunDbReader(path), Catch::Contains("no table gpu_time"));
}

TEST_CASE("a gpu_time phase no writer writes is reported as corruption", "[rundb][gpu]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "INSERT INTO gpu_time VALUES (0, 0, 9, 0, 1, 1);");
  REQUIRE_THROWS_WITH(RunDbReader(path).gpu_time(), Catch::Contains("gpu_time") && Catch::Contains("phase 9"));
}
