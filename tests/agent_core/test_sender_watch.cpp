// SenderWatch, the decisions of the look at which module's backward sends a module's NaN/Inf
// back into it, that both agents share (agent/core/sender_watch.h). The agents' hooks are
// tested in tests/agent and tests/scenarios.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "sender_watch.h"

using ampdiag::agent::SenderWatch;
using Call = SenderWatch::Call;

TEST_CASE("the modules around and inside the watched one are not its users", "[sender-watch]") {
  SenderWatch w;
  CHECK_FALSE(w.user("head"));  // nothing armed
  w.arm("backbone.0");
  CHECK(w.user("head"));
  CHECK(w.user("backbone.1"));
  CHECK_FALSE(w.user("backbone"));
  CHECK_FALSE(w.user("backbone.0"));
  CHECK_FALSE(w.user("backbone.0.conv"));
  CHECK_FALSE(w.user(""));
}

TEST_CASE("the module that received a finite gradient and sent NaN/Inf back is named at a skip naming the watched one",
          "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  // cls's backward ran first and sent a finite gradient; box received a finite one and sent Inf.
  CHECK(w.step_ended("enc", {{"cls", 0, -1}, {"box", 0, 0}}) == "enc: box");
  CHECK_FALSE(w.armed());
}

TEST_CASE("a module that received NaN/Inf only passed them on", "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  CHECK(w.step_ended("enc", {{"mix", 1, 0}}).empty());
  CHECK_FALSE(w.armed());  // looked at: the skip answered
}

TEST_CASE("several senders are named in the order they sent", "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  CHECK(w.step_ended("enc", {{"aux", 0, 1}, {"head", 0, 0}, {"head", 0, 2}}) == "enc: head, aux");
}

TEST_CASE("of a block and the layer inside it that both sent them, the layer is named", "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  CHECK(w.step_ended("enc", {{"head", 0, 1}, {"head.fc", 0, 0}}) == "enc: head.fc");
}

TEST_CASE("a step that names another module, or none, waits", "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  CHECK(w.step_ended("", {{"box", 0, 0}}).empty());
  CHECK(w.step_ended("dec", {{"box", 0, 0}}).empty());
  CHECK(w.armed());
  CHECK(w.step_ended("enc", {{"box", 0, 0}}) == "enc: box");
}

TEST_CASE("a sender watch no skip answers within kWatchSteps steps is dropped", "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  for (int k = 1; k < SenderWatch::kWatchSteps; ++k) w.step_ended("", {});
  CHECK(w.armed());
  w.step_ended("", {});
  CHECK_FALSE(w.armed());
}

TEST_CASE("each module is looked at once, and a watch moves to the latest one armed", "[sender-watch]") {
  SenderWatch w;
  w.arm("enc");
  w.arm("dec");
  CHECK(w.target() == "dec");
  w.step_ended("dec", {{"box", 0, -1}});
  w.arm("dec");
  CHECK_FALSE(w.armed());
}
