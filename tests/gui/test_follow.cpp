// RunFollower: a run.db that is still being written is loaded again when it changes.
#include <catch2/catch.hpp>

#include <thread>

#include "../analyzer/run_fixture.h"
#include "../rundb/temp_dir.h"
#include "follow.h"

using namespace ampdiag;

namespace {

// Polls until a reload arrives or 20 s pass.
std::optional<analyzer::Run> wait_for_reload(gui::RunFollower& f) {
  for (int i = 0; i < 2000; ++i) {
    if (auto run = f.poll()) return run;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("a followed run.db is reloaded with the steps written since", "[gui]") {
  test::TempDir dir;
  const auto path = dir.file("run.db");
  test::RunFixture run(path, {"a.weight", "b.weight"});
  for (int i = 0; i < 5; ++i) run.step(65536, 65536);
  run.commit();
  gui::RunFollower follower(path, std::chrono::milliseconds(0));
  CHECK_FALSE(follower.poll());  // nothing changed since it was made
  for (int i = 0; i < 7; ++i) run.step(65536, 32768, 1000, {"a.weight"});
  run.commit();
  const auto reloaded = wait_for_reload(follower);
  REQUIRE(reloaded);
  CHECK(reloaded->steps.size() == 12);
  CHECK(reloaded->layers[0].nonfinite_steps == 7);
  CHECK(follower.error().empty());
}

TEST_CASE("a follower that cannot load keeps quiet until the file changes again", "[gui]") {
  test::TempDir dir;
  const auto path = dir.file("run.db");
  test::RunFixture run(path, {"a.weight"});
  run.commit();  // no steps yet: loading fails ("holds no steps")
  gui::RunFollower follower(path, std::chrono::milliseconds(0));
  run.meta("note", "x").commit();  // a change, still without steps
  for (int i = 0; i < 200 && follower.error().empty(); ++i) {
    CHECK_FALSE(follower.poll());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK_THAT(follower.error(), Catch::Contains("no steps"));
  run.step(65536, 65536);
  run.commit();
  const auto reloaded = wait_for_reload(follower);
  REQUIRE(reloaded);
  CHECK(reloaded->steps.size() == 1);
}
