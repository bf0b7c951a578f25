// RunFollower: a run.db that is still being written is read on from the run's cursor when
// it changes, and loaded whole when it cannot be read on.
#include <catch2/catch.hpp>

#include <thread>

#include "../analyzer/random_run.h"
#include "../analyzer/run_fixture.h"
#include "../rundb/temp_dir.h"
#include "follow.h"

using namespace ampdiag;

namespace {

// Polls until a read arrives or 20 s pass.
std::optional<gui::RunFollower::Update> wait_for_update(gui::RunFollower& f, const analyzer::RunCursor& cursor) {
  for (int i = 0; i < 2000; ++i) {
    if (auto update = f.poll(cursor)) return update;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("a followed run.db gains the steps written since, without a whole load", "[gui]") {
  test::TempDir dir;
  const auto path = dir.file("run.db");
  test::RunFixture run(path, {"a.weight", "b.weight"});
  for (int i = 0; i < 5; ++i) run.step(65536, 65536);
  run.commit();
  auto shown = test::load_partial(path);
  gui::RunFollower follower(path, std::chrono::milliseconds(0));
  CHECK_FALSE(follower.poll(shown.cursor));  // nothing changed since it was made
  for (int i = 0; i < 7; ++i) run.step(65536, 32768, 1000, {"a.weight"});
  run.commit();
  auto update = wait_for_update(follower, shown.cursor);
  REQUIRE(update);
  CHECK_FALSE(update->whole);
  CHECK(update->delta.steps.size() == 7);
  analyzer::apply_run_delta(shown, std::move(update->delta));
  CHECK(shown.steps.size() == 12);
  CHECK(shown.layers[0].nonfinite_steps == 7);
  CHECK(follower.error().empty());
}

TEST_CASE("a followed file that holds another run now is loaded whole", "[gui]") {
  test::TempDir dir;
  const auto path = dir.file("run.db");
  analyzer::Run shown;
  {
    test::RunFixture run(path, {"a.weight"});
    run.meta("run_id", "first");
    for (int i = 0; i < 5; ++i) run.step(65536, 65536);
    run.commit();
    shown = test::load_partial(path);
  }
  gui::RunFollower follower(path, std::chrono::milliseconds(0));
  test::RunFixture again(path, {"a.weight", "b.weight"});  // overwrites it
  again.meta("run_id", "second");
  for (int i = 0; i < 3; ++i) again.step(65536, 65536);
  again.commit();
  const auto update = wait_for_update(follower, shown.cursor);
  REQUIRE(update);
  REQUIRE(update->whole);
  CHECK(update->whole->steps.size() == 3);
  CHECK(update->whole->layers.size() == 2);
}

TEST_CASE("a follower that cannot load keeps quiet until the file changes again", "[gui]") {
  test::TempDir dir;
  const auto path = dir.file("run.db");
  test::RunFixture run(path, {"a.weight"});
  run.commit();  // no steps yet: loading fails ("holds no steps")
  gui::RunFollower follower(path, std::chrono::milliseconds(0));
  const analyzer::RunCursor nothing_read;
  run.meta("note", "x").commit();  // a change, still without steps
  for (int i = 0; i < 200 && follower.error().empty(); ++i) {
    CHECK_FALSE(follower.poll(nothing_read));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK_THAT(follower.error(), Catch::Contains("no steps"));
  run.step(65536, 65536);
  run.commit();
  const auto update = wait_for_update(follower, nothing_read);
  REQUIRE(update);
  REQUIRE(update->whole);
  CHECK(update->whole->steps.size() == 1);
}
