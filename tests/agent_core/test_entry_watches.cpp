// EntryWatches, the decisions of the look at the gradient reaching a module's output that
// both agents share (agent/core/entry_watches.h): what is watched after a skip, which skip
// judges it, and the limits. The agents' hooks are tested in tests/agent and tests/python.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "entry_watches.h"

using ampdiag::agent::EntryWatches;

namespace {

constexpr int kNot = EntryWatches::kNotSeen;
constexpr int kFin = EntryWatches::kFinite;
constexpr int kNan = EntryWatches::kNonfinite;

std::vector<std::string> paths(const EntryWatches& w) {
  std::vector<std::string> out;
  for (const auto& watch : w.watches()) out.push_back(watch.path);
  return out;
}

std::vector<std::string> details(const EntryWatches::Ended& e) {
  std::vector<std::string> out;
  for (const auto& event : e.events) out.push_back(event.kind + " " + event.detail);
  return out;
}

}  // namespace

TEST_CASE("a skip that names a module watches it and the other modules that went NaN/Inf in it",
          "[entry-watches]") {
  EntryWatches w;
  const auto e = w.step_ended("k", {"q", "v"}, {});
  CHECK(e.events.empty());
  CHECK(paths(w) == std::vector<std::string>{"k", "q", "v"});
}

TEST_CASE("at most kCompanions modules are watched beside the one named", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {"a", "b", "c", "d", "e"}, {});
  CHECK(paths(w) == std::vector<std::string>{"k", "a", "b", "c"});
}

TEST_CASE("the next skip that names the module judges what reached its output", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {}, {});
  SECTION("finite: its own backward made the NaN/Inf") {
    const auto e = w.step_ended("k", {}, {kFin});
    CHECK(details(e) == std::vector<std::string>{"module-output-gradient k: finite"});
    CHECK(e.nonfinite.empty());
  }
  SECTION("nonfinite: it received them, and its sender is next") {
    const auto e = w.step_ended("k", {}, {kNan});
    CHECK(details(e) == std::vector<std::string>{"module-output-gradient k: nonfinite"});
    CHECK(e.nonfinite == "k");
  }
  CHECK_FALSE(w.armed());
}

TEST_CASE("a skip naming the module when no gradient reached its output judges nothing", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {}, {});
  CHECK(w.step_ended("k", {}, {kNot}).events.empty());
  CHECK(paths(w) == std::vector<std::string>{"k"});
  CHECK(details(w.step_ended("k", {}, {kFin})) == std::vector<std::string>{"module-output-gradient k: finite"});
}

TEST_CASE("a step that was not skipped judges nothing, even with a gradient seen", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {}, {});
  CHECK(w.step_ended("", {}, {kNan}).events.empty());
  CHECK(w.armed());
}

TEST_CASE("a companion is judged at a skip naming the module where its gradients went NaN/Inf again",
          "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {"q", "v"}, {});
  // q stayed finite in this skip: only v is judged, and the watch goes on for q.
  auto e = w.step_ended("k", {"v"}, {kFin, kFin, kNan});
  CHECK(details(e) == std::vector<std::string>{"module-output-gradient k: finite",
                                                "companion-output-gradient v: nonfinite, beside k"});
  CHECK(w.armed());
  e = w.step_ended("k", {"q"}, {kNot, kFin, kNot});
  CHECK(details(e) == std::vector<std::string>{"companion-output-gradient q: finite, beside k"});
  CHECK_FALSE(w.armed());
}

TEST_CASE("a companion's verdict leaves its own verdict as a named module to come", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {"q"}, {});
  w.step_ended("k", {"q"}, {kFin, kFin});
  w.step_ended("q", {}, {});
  CHECK(paths(w) == std::vector<std::string>{"q"});
  CHECK(details(w.step_ended("q", {}, {kFin})) == std::vector<std::string>{"module-output-gradient q: finite"});
}

TEST_CASE("a companion judged beside a module is not watched beside it again, but is beside another",
          "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {"q"}, {});
  w.step_ended("k", {"q"}, {kNot, kFin});  // q judged; k's own verdict still to come
  w.step_ended("m", {"q"}, {});
  CHECK(paths(w) == std::vector<std::string>{"m", "q"});
  w.step_ended("k", {"q"}, {});
  CHECK(paths(w) == std::vector<std::string>{"k"});
}

TEST_CASE("a skip naming another module moves the watch there", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {"q"}, {});
  CHECK(w.step_ended("m", {}, {kFin, kFin}).events.empty());
  CHECK(paths(w) == std::vector<std::string>{"m"});
}

TEST_CASE("a module judged nonfinite is judged once", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {}, {});
  w.step_ended("k", {}, {kNan});
  w.step_ended("k", {}, {});
  CHECK_FALSE(w.armed());
}

TEST_CASE("a module judged finite is watched once more from a later skip naming it, and judged again",
          "[entry-watches]") {
  // A log-variance head: its own backward overflowed in the scaler's first skips, and the
  // Gaussian likelihood's exp() sent it NaN/Inf through its output once the variance was small.
  EntryWatches w;
  w.step_ended("k", {}, {});
  w.step_ended("k", {}, {kFin});
  w.step_ended("k", {}, {});
  CHECK(paths(w) == std::vector<std::string>{"k"});
  const auto e = w.step_ended("k", {}, {kNan});
  CHECK(details(e) == std::vector<std::string>{"module-output-gradient k: nonfinite"});
  CHECK(e.nonfinite == "k");
  w.step_ended("k", {}, {});
  CHECK_FALSE(w.armed());
}

TEST_CASE("a module judged finite twice is not watched a third time", "[entry-watches]") {
  EntryWatches w;
  for (int look = 0; look < 2; ++look) {
    w.step_ended("k", {}, {});
    REQUIRE(w.step_ended("k", {}, {kFin}).events.size() == 1);
  }
  w.step_ended("k", {}, {});
  CHECK_FALSE(w.armed());
}

TEST_CASE("at most kVerdicts modules are judged in a run", "[entry-watches]") {
  EntryWatches w;
  for (int k = 0; k < EntryWatches::kVerdicts; ++k) {
    const std::string path = "m" + std::to_string(k);
    w.step_ended(path, {}, {});
    REQUIRE(w.step_ended(path, {}, {kFin}).events.size() == 1);
  }
  w.step_ended("late", {}, {});
  CHECK_FALSE(w.armed());
}

TEST_CASE("a watch no skip answers within kWatchSteps steps is dropped", "[entry-watches]") {
  EntryWatches w;
  w.step_ended("k", {}, {});
  for (int k = 1; k < EntryWatches::kWatchSteps; ++k) w.step_ended("", {}, {kFin});
  CHECK(w.armed());
  w.step_ended("", {}, {});
  CHECK_FALSE(w.armed());
}
