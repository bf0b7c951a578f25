// The writer's failures are clear errors that lose nothing: a second writer on a file in
// use is refused, a path with a NUL byte is refused, and a creation that fails (here: the
// process may not write a byte, as on a full disk) leaves no file behind.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "child_process.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::TempDir;
using ampdiag::test::forbid_file_growth;
using ampdiag::test::in_child;

TEST_CASE("a second writer on a run.db that is being written is refused, even with overwrite", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  RunDbWriter first(path, false);
  StepRow s;
  s.step = 0;
  first.add_step(s);
  first.commit();
  REQUIRE_THROWS_WITH(RunDbWriter(path, true), Catch::Contains("another ampdiag writer"));
  first.finish();
  RunDbReader reader(path);
  REQUIRE(reader.steps().size() == 1);  // the first run's step is still there
}

TEST_CASE("a writer in another process holds its run.db against this one", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  int ready[2], done[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(done) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    RunDbWriter w(path, false);
    char c = 1;
    (void)!::write(ready[1], &c, 1);
    (void)!::read(done[0], &c, 1);  // hold the file until the parent has tried
    ::_exit(0);
  }
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  REQUIRE_THROWS_WITH(RunDbWriter(path, true), Catch::Contains("another ampdiag writer"));
  (void)!::write(done[1], &c, 1);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE_NOTHROW(RunDbWriter(path, true));  // free once that writer is gone
}

TEST_CASE("a run.db path with a NUL byte is refused, not cut short", "[rundb]") {
  TempDir dir;
  const std::string path = dir.file("run") + std::string(1, '\0') + ".db";
  REQUIRE_THROWS_WITH(RunDbWriter(path, true), Catch::Contains("NUL"));
  REQUIRE_THROWS_WITH(RunDbReader(path), Catch::Contains("NUL"));
  REQUIRE_FALSE(std::filesystem::exists(dir.file("run")));
}

TEST_CASE("a run.db that cannot be created on a full disk leaves no file behind", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  const int code = in_child([&] {
    forbid_file_growth(0);
    try {
      RunDbWriter w(path, false);
      return 1;  // created although nothing may be written
    } catch (const RunDbError&) {
      return 0;
    }
  });
  REQUIRE(code == 0);
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) REQUIRE_FALSE(std::filesystem::exists(path + suffix));
}

TEST_CASE("a failed commit can be rolled back and what was committed before stays readable", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  const int code = in_child([&] {
    RunDbWriter w(path, false);
    StepRow s;
    s.step = 0;
    w.add_step(s);
    w.commit();
    forbid_file_growth(64 * 1024);  // far less than the rows below need
    try {
      for (int i = 0; i < 5000; ++i) {
        GradStatRow g;
        g.step = 1;
        g.layer_id = i;
        w.add_grad_stat(g);
      }
      w.commit();
      return 1;
    } catch (const RunDbError&) {
      w.rollback();
    }
    return 0;
  });
  REQUIRE(code == 0);
  RunDbReader reader(path);
  REQUIRE(reader.steps().size() == 1);
  REQUIRE(reader.grad_stats().empty());
}
