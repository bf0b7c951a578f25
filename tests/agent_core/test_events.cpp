// Events the adapters post: once per key, at the current step, or at an earlier step
// named by the adapter when what it reports was read back from a device after that step
// ended (the Python agent's stale-gradient probe on CUDA).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampdiag/rundb/reader.h"
#include "session.h"
#include "session_fixture.h"
#include "../rundb/temp_dir.h"

using namespace ampdiag;
using test::open_with_layers;
using test::recording_options;
using test::TempDir;

namespace {

// One optimizer cycle with no gradients, ended at scale 1024.
void cycle(agent::Session& s) {
  s.begin_cycle();
  agent::StepOutcome o;
  o.loss = 1.0;
  o.losses = 1;
  o.scale_before = o.scale_after = 1024.0;
  s.end_step(o, 0);
}

// `s` recording into `path`, step 0 ended and step 1 open.
void open_at_step_one(agent::Session& s, const std::string& path) {
  open_with_layers(s, path, 1);
  cycle(s);
  s.begin_cycle();
}

struct Event {
  std::int64_t step;
  std::string kind;
  bool operator==(const Event& other) const { return step == other.step && kind == other.kind; }
};

std::vector<Event> events_of(const std::string& path) {
  rundb::RunDbReader r(path);
  std::vector<Event> out;
  for (const auto& e : r.events()) out.push_back({e.step, e.kind});
  return out;
}

}  // namespace

TEST_CASE("an event read back after its step carries the step it names, once per key", "[session][events]") {
  TempDir dir;
  {
    agent::Session s(recording_options());
    open_with_layers(s, dir.file("run.db"), 1);
    for (int i = 0; i < 3; ++i) cycle(s);
    s.begin_cycle();  // step 3 is open
    s.event_once("probe", "gradients-not-zeroed", "seen at step 1", std::int64_t{1});
    s.event_once("probe", "gradients-not-zeroed", "seen again at step 2", std::int64_t{2});
    s.event_once("now", "half-loss", "at the current step");
    s.close();
  }
  CHECK(events_of(dir.file("run.db")) == std::vector<Event>{{1, "gradients-not-zeroed"}, {3, "half-loss"}});
}

TEST_CASE("an event may not name a step the run has not reached, nor a negative one", "[session][events]") {
  TempDir dir;
  agent::Session s(recording_options());
  open_at_step_one(s, dir.file("run.db"));
  CHECK_THROWS_AS(s.event_once("ahead", "gradients-not-zeroed", "", std::int64_t{2}), std::invalid_argument);
  CHECK_THROWS_AS(s.event_once("negative", "gradients-not-zeroed", "", std::int64_t{-1}), std::invalid_argument);
  s.event_once("ahead", "gradients-not-zeroed", "", std::int64_t{1});  // the key was not used up by the refusal
  s.close();
  CHECK(events_of(dir.file("run.db")) == std::vector<Event>{{1, "gradients-not-zeroed"}});
}

TEST_CASE("a precision check is written at the step it was made in", "[session][precision]") {
  TempDir dir;
  {
    agent::Session s(recording_options());
    open_at_step_one(s, dir.file("run.db"));
    s.precision_check("norm", "float32", 2048, 0.997, 2040, 3.7);
    s.close();
  }
  const auto rows = rundb::RunDbReader(dir.file("run.db")).precision_checks();
  REQUIRE(rows.size() == 1);
  CHECK((rows[0].step == 1 && rows[0].module == "norm" && rows[0].zeroed == 2040));
}

TEST_CASE("a precision check no comparison gives is refused to the adapter, not left to the writer",
          "[session][precision]") {
  // The writer thread would stop the recording on it: the adapter gets the error instead.
  TempDir dir;
  agent::Session s(recording_options());
  open_with_layers(s, dir.file("run.db"), 1);
  s.begin_cycle();
  REQUIRE_THROWS_AS(s.precision_check("norm", "float16", 8, 0.5, 9, 1.0), std::invalid_argument);
  REQUIRE_THROWS_AS(s.precision_check("norm", "float16", 8, -1.0, 0, 1.0), std::invalid_argument);
  REQUIRE_THROWS_AS(s.precision_check("norm", "float16", 8, 0.5, 0, 0.0), std::invalid_argument);
  s.close();
  CHECK(rundb::RunDbReader(dir.file("run.db")).precision_checks().empty());
}

TEST_CASE("a weight norm of a layer the session never registered is refused to the adapter", "[session][weight-norms]") {
  TempDir dir;
  agent::Session s(recording_options());
  open_at_step_one(s, dir.file("run.db"));
  s.weight_norm(0, 3.0, 1.5);
  REQUIRE_THROWS_AS(s.weight_norm(1, 3.0, 1.5), std::invalid_argument);  // one layer: id 0
  REQUIRE_THROWS_AS(s.weight_norm(0, 1.0, 1.5), std::invalid_argument);
  s.close();
  const auto rows = rundb::RunDbReader(dir.file("run.db")).weight_norms();
  REQUIRE(rows.size() == 1);
  CHECK((rows[0].step == 1 && rows[0].layer_id == 0 && rows[0].l2 == 3.0));
}

TEST_CASE("a weight norm read back after its step is recorded at that step, and one of a step not reached is refused",
          "[session][weight-norms]") {
  TempDir dir;
  agent::Session s(recording_options());
  open_at_step_one(s, dir.file("run.db"));
  s.weight_norm(0, 3.0, 1.5, std::int64_t(0));  // a device read of step 0, landed at step 1
  REQUIRE_THROWS_AS(s.weight_norm(0, 3.0, 1.5, std::int64_t(2)), std::invalid_argument);
  s.close();
  const auto rows = rundb::RunDbReader(dir.file("run.db")).weight_norms();
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].step == 0);
}

TEST_CASE("weight norms of several host tensors come from one pass, and a tensor holding NaN has none",
          "[session][weight-norms]") {
  TempDir dir;
  agent::Session s(recording_options());
  open_with_layers(s, dir.file("run.db"), 3);
  cycle(s);
  s.begin_cycle();
  const std::vector<float> a{3.0f, -4.0f};
  const std::vector<float> b{1.0f, std::nanf("")};
  const std::vector<std::uint16_t> c{0x7BFF, 0xFBFF};  // float16 +-65504: their squares pass fp16's range
  const std::vector<std::int64_t> layers{0, 1, 2};
  const std::vector<kernels::TensorRef> refs{{a.data(), 2, kernels::DType::kFloat32},
                                             {b.data(), 2, kernels::DType::kFloat32},
                                             {c.data(), 2, kernels::DType::kFloat16}};
  s.weight_norms(layers.data(), refs.data(), refs.size());
  s.close();
  const auto rows = rundb::RunDbReader(dir.file("run.db")).weight_norms();
  REQUIRE(rows.size() == 2);
  CHECK((rows[0].layer_id == 0 && rows[0].l2 == 5.0 && rows[0].absmax == 4.0));
  CHECK((rows[1].layer_id == 2 && rows[1].l2 == Approx(65504.0 * std::sqrt(2.0)) && rows[1].absmax == 65504.0));
}

TEST_CASE("a precision check read back from a device carries the step it was made in", "[session][precision]") {
  TempDir dir;
  {
    agent::Session s(recording_options());
    open_at_step_one(s, dir.file("run.db"));
    REQUIRE_THROWS_AS(s.precision_check("norm", "float16", 8, 0.5, 0, 1.0, std::int64_t{2}), std::invalid_argument);
    s.precision_check("norm", "float16", 8, 0.5, 0, 1.0, std::int64_t{0});
    s.close();
  }
  const auto rows = rundb::RunDbReader(dir.file("run.db")).precision_checks();
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].step == 0);
}
