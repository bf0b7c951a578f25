// The torch-free session core's tickets: device statistics and outcomes from a fake
// deferred engine whose results land late, out of order, or never (fake_device.h).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "fake_device.h"

using namespace ampdiag;
using namespace ampdiag::test;

TEST_CASE("a step waits for its late tickets and is recorded with them, in step order", "[session][tickets]") {
  FakeDeviceRun run(2, /*max_waiting=*/8);
  agent::Session& s = run.session;
  for (int step = 0; step < 5; ++step) device_cycle(s, 2);
  // Results land out of order: step 3's first, step 0's last.
  for (std::size_t k : {3, 1, 2, 4, 0}) run.land(k);
  device_cycle(s, 2);  // the next cycle settles what landed
  run.land(5);
  s.close();
  CHECK(s.counters().dropped_steps == 0);
  rundb::RunDbReader r(run.db());
  const auto steps = r.steps();
  REQUIRE(steps.size() == 6);
  const auto rows = r.grad_stats();
  REQUIRE(rows.size() == 12);
  for (std::size_t i = 1; i < rows.size(); ++i) CHECK(rows[i].step >= rows[i - 1].step);  // written in step order
  for (int step = 0; step < 6; ++step) {
    const auto g = grads_of(r, step);
    REQUIRE(g.size() == 2);
    CHECK(g[0].bwd_order == 1);  // the order of arrival, as it was when the step ran
    CHECK(g[1].bwd_order == 0);
    CHECK(g[1].stats.absmax == 2.0f);
  }
}

TEST_CASE("a ticket that never lands makes its step a counted drop, recorded without statistics", "[session][tickets]") {
  FakeDeviceRun run(2, /*max_waiting=*/2);
  agent::Session& s = run.session;
  device_cycle(s, 2);  // step 0: never lands
  for (int step = 1; step < 6; ++step) {
    device_cycle(s, 2);
    run.land(std::size_t(step));
  }
  s.close();
  CHECK(s.counters().dropped_steps == 1);
  rundb::RunDbReader r(run.db());
  REQUIRE(r.steps().size() == 6);
  CHECK(grads_of(r, 0).empty());
  for (int step = 1; step < 6; ++step) CHECK(grads_of(r, step).size() == 2);
  CHECK(r.meta()["dropped_steps"] == "1");
  const auto events = r.events();
  CHECK(std::count_if(events.begin(), events.end(), [](const rundb::EventRow& e) {
          return e.kind == "stats-dropped" && e.step == 0;
        }) == 1);
}

TEST_CASE("tickets still out when the run closes are dropped after the bounded wait", "[session][tickets]") {
  FakeDeviceRun run(1, /*max_waiting=*/8);
  agent::Session& s = run.session;
  for (int step = 0; step < 3; ++step) device_cycle(s, 1);
  s.close();
  CHECK(s.counters().dropped_steps == 3);
  rundb::RunDbReader r(run.db());
  CHECK(r.steps().size() == 3);
  CHECK(r.grad_stats().empty());
}

TEST_CASE("an engine with no free slot drops that step's device statistics, counted", "[session][tickets]") {
  FakeDeviceRun run(1);
  agent::Session& s = run.session;
  run.fake->busy = true;
  device_cycle(s, 1);
  device_cycle(s, 1);
  s.close();
  CHECK(s.counters().dropped_steps == 2);
}

TEST_CASE("device activations land as tickets at their forward position", "[session][tickets]") {
  FakeDeviceRun run(1);
  agent::Session& s = run.session;
  std::vector<float> host(8, 3.0f);
  s.begin_cycle();
  const auto a = s.module_id("enc", "Linear", "", "");
  const auto b = s.module_id("dec", "Linear", "", "");
  CHECK_FALSE(s.activation(a, on_gpu(5), 0));  // a device result is not known yet
  CHECK_FALSE(s.activation(b, {{host.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0));
  device_cycle(s, 1);
  for (auto& l : *run.launches) l->landed = true;
  s.close();
  rundb::RunDbReader r(run.db());
  auto acts = r.act_stats();
  REQUIRE(acts.size() == 2);
  std::sort(acts.begin(), acts.end(), [](const auto& x, const auto& y) { return x.fwd_order < y.fwd_order; });
  CHECK(acts[0].module_id == 0);
  CHECK(acts[0].stats.absmax == 1.0f);  // from the fake engine
  CHECK(acts[1].module_id == 1);
  CHECK(acts[1].stats.absmax == 3.0f);  // from the CPU engine
  CHECK(acts[1].histogram.empty());  // histograms are off
}

TEST_CASE("with histograms on, a device activation's launch asks for its histogram", "[session][tickets]") {
  agent::SessionOptions o = options();
  o.histogram = true;
  FakeDeviceRun run(1, o);
  agent::Session& s = run.session;
  s.begin_cycle();
  s.activation(s.module_id("enc", "Linear", "", ""), on_gpu(5), 0);
  REQUIRE(run.launches->size() == 1);
  CHECK(run.launches->at(0)->as.activation);
  CHECK(run.launches->at(0)->launch.histogram);
}

TEST_CASE("outcome scalars read back from the device complete their step when they land", "[session][tickets]") {
  FakeDeviceRun run(1);
  agent::Session& s = run.session;
  const double values[] = {2.5, 1024.0, 512.0, 1.0};  // loss, scale before, after, found_inf
  const auto later = device_outcome(values, kWholeOutcome);
  device_cycle(s, 1, std::nan(""), &later);
  REQUIRE(run.fake->readbacks->size() == 1);
  device_cycle(s, 1);  // the next step: the first is still waiting for its outcome
  run.land_all();
  s.close();
  rundb::RunDbReader r(run.db());
  const auto steps = r.steps();
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].loss == 2.5);
  CHECK(steps[0].scale_before == 1024.0);
  CHECK(steps[0].scale_after == 512.0);
  CHECK(steps[0].found_inf);
  CHECK(steps[0].skipped);
  CHECK_FALSE(steps[1].found_inf);
}

TEST_CASE("an overflow known only when its outcome lands still decides what is sampled", "[session][tickets]") {
  agent::SessionOptions o = options(8);
  o.recorder.every = 100;
  FakeDeviceRun run(1, o);
  agent::Session& s = run.session;
  const double clean[] = {1.0, 1024.0, 1024.0, 0.0};
  const double overflow[] = {1.0, 1024.0, 512.0, 1.0};
  const auto clean_later = device_outcome(clean, kWholeOutcome);
  const auto overflow_later = device_outcome(overflow, kWholeOutcome);
  device_cycle(s, 1, 1024.0, &clean_later);     // step 0: every 100th step is sampled
  device_cycle(s, 1, 1024.0, &clean_later);     // step 1: not sampled
  device_cycle(s, 1, 1024.0, &overflow_later);  // step 2: sampled, once its found_inf is known
  run.land_all();
  s.close();
  rundb::RunDbReader r(run.db());
  CHECK(grads_of(r, 0).size() == 1);
  CHECK(grads_of(r, 1).empty());
  CHECK(grads_of(r, 2).size() == 1);
}

TEST_CASE("an extra update() on the device amends the pending step's scale when it lands", "[session][tickets]") {
  FakeDeviceRun run(1);
  agent::Session& s = run.session;
  const double cycle[] = {1.0, 1024.0, 2048.0, 0.0};
  const double extra[] = {0.0, 0.0, 128.0, 0.0};
  const auto later = device_outcome(cycle, kWholeOutcome);
  CHECK_FALSE(s.amend_outcome(device_outcome(extra, agent::DeviceOutcome::kScaleAfter)));  // no step yet
  device_cycle(s, 1, std::nan(""), &later);
  CHECK(s.amend_outcome(device_outcome(extra, agent::DeviceOutcome::kScaleAfter)));
  run.land_all();
  s.close();
  rundb::RunDbReader r(run.db());
  const auto steps = r.steps();
  REQUIRE(steps.size() == 1);
  CHECK(steps[0].scale_before == 1024.0);
  CHECK(steps[0].scale_after == 128.0);  // the later read-back wins
}

TEST_CASE("an outcome read-back with no free slot leaves the step as the adapter gave it, counted", "[session][tickets]") {
  FakeDeviceRun run(1);
  agent::Session& s = run.session;
  run.fake->busy = true;
  const double values[] = {1.0, 1024.0, 512.0, 1.0};
  const auto later = device_outcome(values, kWholeOutcome);
  device_cycle(s, 1, 4096.0, &later);
  s.close();
  CHECK(s.counters().dropped_steps == 1);
  rundb::RunDbReader r(run.db());
  REQUIRE(r.steps().size() == 1);
  CHECK(r.steps()[0].scale_after == 4096.0);
}
