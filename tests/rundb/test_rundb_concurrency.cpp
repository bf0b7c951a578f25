// A run.db is readable from another process while it is written, and what was committed
// survives the writer being killed with SIGKILL.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::TempDir;

namespace {

// Child process: writes one step per millisecond, committing every 10, forever.
[[noreturn]] void write_forever(const std::string& path) {
  try {
    RunDbWriter w(path, false);
    for (std::int64_t step = 0;; ++step) {
      StepRow s;
      s.step = step;
      w.add_step(s);
      if (step % 10 == 9) w.commit();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  } catch (...) {
    _exit(3);
  }
}

std::size_t steps_readable(const std::string& path) {
  try {
    RunDbReader r(path);
    return r.steps().size();
  } catch (const RunDbError&) {
    return 0;  // not created yet
  }
}

}  // namespace

TEST_CASE("a run.db is readable while another process writes it, and survives SIGKILL", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("live.db");
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) write_forever(path);

  std::size_t seen = 0;
  for (int i = 0; i < 500 && seen < 100; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = steps_readable(path);
  }
  REQUIRE(seen >= 100);  // read while the writer is running

  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  REQUIRE(WIFSIGNALED(status));

  RunDbReader after(path);
  CHECK_FALSE(after.finished());
  const auto steps = after.steps();
  CHECK(steps.size() >= seen);  // nothing committed is lost
  for (std::size_t i = 0; i < steps.size(); ++i) REQUIRE(steps[i].step == std::int64_t(i));
}
