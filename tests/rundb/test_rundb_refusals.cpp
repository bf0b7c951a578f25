// Bad files and bad paths get one clear line, never a crash.
#include <catch2/catch.hpp>

#include <fstream>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "run_sql.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::run_sql;
using ampdiag::test::TempDir;

namespace {

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

}  // namespace

TEST_CASE("the writer refuses to replace an existing file unless told to", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  { RunDbWriter first(path, false); }
  REQUIRE_THROWS_WITH(RunDbWriter(path, false), Catch::Contains("already exists"));
  REQUIRE_NOTHROW(RunDbWriter(path, true));
}

TEST_CASE("the writer names an unwritable path", "[rundb]") {
  TempDir dir;
  REQUIRE_THROWS_WITH(RunDbWriter(dir.file("missing-dir/run.db"), false), Catch::Contains("missing-dir/run.db"));
  REQUIRE_THROWS_WITH(RunDbWriter(dir.path().string(), false), Catch::Contains("is a directory"));
  REQUIRE_THROWS_WITH(RunDbWriter("", false), Catch::Contains("empty"));
}

TEST_CASE("the reader refuses a missing file", "[rundb]") {
  TempDir dir;
  REQUIRE_THROWS_WITH(RunDbReader(dir.file("nope.db")), Catch::Contains("no such file"));
}

TEST_CASE("the reader refuses an empty file", "[rundb]") {
  TempDir dir;
  write_file(dir.file("empty.db"), "");
  REQUIRE_THROWS_WITH(RunDbReader(dir.file("empty.db")), Catch::Contains("is empty"));
}

TEST_CASE("the reader refuses a file that is not SQLite", "[rundb]") {
  TempDir dir;
  write_file(dir.file("text.db"), "this is a text file, not a database, with enough bytes to look like one");
  REQUIRE_THROWS_WITH(RunDbReader(dir.file("text.db")), Catch::Contains("not a SQLite database"));
}

TEST_CASE("the reader refuses a SQLite file that is not a run.db", "[rundb]") {
  TempDir dir;
  run_sql(dir.file("other.db"), "CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1);");
  REQUIRE_THROWS_WITH(RunDbReader(dir.file("other.db")), Catch::Contains("not an ampdiag run.db"));
}

TEST_CASE("the reader refuses a run.db from a newer format", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("future.db");
  { RunDbWriter w(path, false); }
  run_sql(path, "UPDATE meta SET value = '99' WHERE key = 'schema_version';");
  REQUIRE_THROWS_WITH(RunDbReader(path), Catch::Contains("newer") && Catch::Contains("upgrade"));
}

TEST_CASE("the reader refuses a truncated run.db", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    for (int i = 0; i < 2000; ++i) {
      GradStatRow g;
      g.step = i;
      w.add_grad_stat(g);
    }
    w.finish();
  }
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  write_file(path, bytes.substr(0, bytes.size() / 3));
  auto read_all = [&] {
    RunDbReader r(path);
    r.grad_stats();
  };
  REQUIRE_THROWS_AS(read_all(), RunDbError);
}
