// The torch-free session core: the registry and metadata both agents use, CPU statistics
// recorded at once, and device statistics as tickets from a fake deferred engine whose
// results land late, out of order, or never. Device tensors here point at memory no
// host engine may read: a wrong engine choice would crash, not pass.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "ampdiag/rundb/reader.h"
#include "session.h"
#include "session_fixture.h"
#include "../rundb/temp_dir.h"

using namespace ampdiag;
using agent::Device;
using agent::DeviceTensor;
using agent::DeviceType;
using test::open_with_layers;
using test::TempDir;

namespace {

const Device kCpu{DeviceType::kCpu, 0};
const Device kGpu0{DeviceType::kCuda, 0};

// A device engine whose tickets land only when the test says so.
struct FakeEngine final : agent::DeviceEngine {
  struct Launch {
    agent::DeviceLaunch launch;
    std::vector<const void*> data;
    agent::LandAs as;
    bool landed = false;
  };
  struct FakeTicket final : agent::Ticket {
    std::shared_ptr<Launch> launch;
    bool ready() override { return launch->landed; }
    bool wait(std::int64_t) override { return launch->landed; }
    void land(agent::StepSink& step) override {
      for (std::size_t i = 0; i < launch->as.ids.size(); ++i) {
        kernels::TensorStats s;
        s.numel = 8;
        s.absmax = float(launch->as.ids[i] + 1);  // tells the rows apart
        if (launch->as.activation)
          step.act(launch->as.ids[i], launch->as.orders[i], s, nullptr, launch->as.micro_batch);
        else
          step.grad(launch->as.ids[i], launch->as.orders[i], s, nullptr);
      }
    }
    const char* engine() const override { return "cuda"; }
  };

  agent::EngineKind kind() const override { return agent::EngineKind::kCuda; }
  std::string unavailable() const override { return ""; }
  std::unique_ptr<agent::Ticket> launch(const kernels::TensorRef* tensors, std::size_t count,
                                        const agent::DeviceLaunch& l, agent::LandAs as) override {
    if (busy) return nullptr;
    auto record = std::make_shared<Launch>();
    record->launch = l;
    for (std::size_t i = 0; i < count; ++i) record->data.push_back(tensors[i].data);
    record->as = std::move(as);
    launches->push_back(record);
    auto t = std::make_unique<FakeTicket>();
    t->launch = record;
    return t;
  }

  // Outcome read-backs: here `values` is host memory standing in for the device's.
  struct Readback {
    agent::DeviceOutcome outcome;
    bool landed = false;
  };
  struct FakeReadback final : agent::Ticket {
    std::shared_ptr<Readback> readback;
    bool ready() override { return readback->landed; }
    bool wait(std::int64_t) override { return readback->landed; }
    void land(agent::StepSink& step) override {
      agent::apply_outcome(readback->outcome, readback->outcome.values, step.outcome());
    }
    const char* engine() const override { return "cuda"; }
  };
  std::unique_ptr<agent::Ticket> read_outcome(const agent::DeviceOutcome& o) override {
    if (busy) return nullptr;
    auto record = std::make_shared<Readback>();
    record->outcome = o;
    readbacks->push_back(record);
    auto t = std::make_unique<FakeReadback>();
    t->readback = record;
    return t;
  }

  std::shared_ptr<std::vector<std::shared_ptr<Launch>>> launches =
      std::make_shared<std::vector<std::shared_ptr<Launch>>>();
  std::shared_ptr<std::vector<std::shared_ptr<Readback>>> readbacks =
      std::make_shared<std::vector<std::shared_ptr<Readback>>>();
  bool busy = false;
};

// Device memory as far as the host is concerned: reading it would fault.
const void* device_pointer(int k) { return reinterpret_cast<const void*>(std::uintptr_t(0x10) + 0x1000u * unsigned(k)); }

DeviceTensor on_gpu(int k) { return {{device_pointer(k), 8, kernels::DType::kFloat32}, kGpu0, nullptr}; }

agent::SessionOptions options(std::int64_t max_waiting = 4) { return test::recording_options(max_waiting); }

// One optimizer cycle whose gradients (layers 0..n-1) are device tensors; `later`: its
// outcome is read back from the device.
void device_cycle(agent::Session& s, int n, double scale = 1024.0, const agent::DeviceOutcome* later = nullptr) {
  s.begin_cycle();
  for (int i = n - 1; i >= 0; --i) s.arrived(i);  // backward reaches the last layer first
  std::vector<std::int64_t> ids;
  std::vector<DeviceTensor> tensors;
  for (int i = 0; i < n; ++i) {
    ids.push_back(i);
    tensors.push_back(on_gpu(i));
  }
  agent::GradBatch b;
  b.layers = ids.data();
  b.tensors = tensors.data();
  b.count = ids.size();
  s.grads(b);
  agent::StepOutcome o;
  o.loss = 1.0;
  o.losses = 1;
  o.scale_before = o.scale_after = scale;
  s.end_step(o, 0, later);
}

// Outcome values "on the device" (host memory the fake engine reads when it lands).
agent::DeviceOutcome device_outcome(const double* values, unsigned fields) {
  agent::DeviceOutcome o;
  o.device = kGpu0;
  o.values = values;
  o.fields = fields;
  return o;
}

constexpr unsigned kWholeOutcome = agent::DeviceOutcome::kLoss | agent::DeviceOutcome::kScaleBefore |
                                   agent::DeviceOutcome::kScaleAfter | agent::DeviceOutcome::kFoundInf |
                                   agent::DeviceOutcome::kSkippedIsFoundInf;

// A session on a fresh file with `layers` layers and a fake device engine.
struct FakeDeviceRun {
  explicit FakeDeviceRun(int layers, std::int64_t max_waiting = 4) : session(options(max_waiting)) {
    auto engine = std::make_unique<FakeEngine>();
    launches = engine->launches;
    fake = engine.get();
    session.set_device_engine(std::move(engine));
    open_with_layers(session, db(), layers);
  }
  FakeDeviceRun(int layers, agent::SessionOptions o) : session(o) {
    auto engine = std::make_unique<FakeEngine>();
    launches = engine->launches;
    fake = engine.get();
    session.set_device_engine(std::move(engine));
    open_with_layers(session, db(), layers);
  }
  void land_all() {
    for (auto& l : *launches) l->landed = true;
    for (auto& r : *fake->readbacks) r->landed = true;
  }
  std::string db() const { return dir.file("run.db"); }
  void land(std::size_t launch) { (*launches).at(launch)->landed = true; }

  TempDir dir;
  agent::Session session;
  FakeEngine* fake = nullptr;
  std::shared_ptr<std::vector<std::shared_ptr<FakeEngine::Launch>>> launches;
};

std::vector<rundb::GradStatRow> grads_of(rundb::RunDbReader& r, std::int64_t step) {
  std::vector<rundb::GradStatRow> out;
  for (const auto& g : r.grad_stats())
    if (g.step == step) out.push_back(g);
  return out;
}

}  // namespace

TEST_CASE("CPU gradients are computed at once and recorded with their arrival order", "[session]") {
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 2);
    std::vector<float> g0(8, 2.0f), g1(8, std::numeric_limits<float>::infinity());
    const std::int64_t ids[] = {0, 1};
    const DeviceTensor t[] = {{{g0.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                              {{g1.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}};
    s.begin_cycle();
    s.arrived(1);
    s.arrived(0);
    agent::GradBatch b;
    b.layers = ids;
    b.tensors = t;
    b.count = 2;
    CHECK(s.grads(b));  // found_inf from the host pass, at once
    s.end_step({}, 0);
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto rows = grads_of(r, 0);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].layer_id == 0);
  CHECK(rows[0].bwd_order == 1);
  CHECK(rows[0].stats.absmax == 2.0f);
  CHECK(rows[1].bwd_order == 0);
  CHECK(rows[1].stats.inf == 8);
}

TEST_CASE("a step's agent_ns is the adapter's: the session's statistics calls are inside its timing", "[session]") {
  // Both agents time their hooks around the session's calls; if the session added its own
  // time too, the pass would be counted twice.
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 1);
    std::vector<float> grad(std::size_t(1) << 22, 0.5f), output(std::size_t(1) << 20, 0.25f);
    const std::int64_t id = 0;
    const DeviceTensor g{{grad.data(), std::int64_t(grad.size()), kernels::DType::kFloat32}, kCpu, nullptr};
    s.begin_cycle();
    s.activation(s.module_id("m", "Linear", "", ""), {{output.data(), std::int64_t(output.size()),
                                                       kernels::DType::kFloat32}, kCpu, nullptr}, 0);
    agent::GradBatch b;
    b.layers = &id;
    b.tensors = &g;
    b.count = 1;
    s.grads(b);
    s.end_step({}, 1234);
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto steps = r.steps();
  REQUIRE(steps.size() == 1);
  CHECK(steps[0].agent_ns == 1234);
}

TEST_CASE("the engine is chosen by the tensor's device, and device memory never reaches the CPU engine", "[session]") {
  FakeDeviceRun run(3);
  agent::Session& s = run.session;
  CHECK(s.engine_for(kCpu) == agent::EngineKind::kCpu);
  CHECK(s.engine_for(kGpu0) == agent::EngineKind::kCuda);
  CHECK(s.engine_for({DeviceType::kCuda, 3}) == agent::EngineKind::kCuda);
  device_cycle(s, 3);
  const auto& launches = run.launches;
  REQUIRE(launches->size() == 1);  // one launch for the device's gradients
  CHECK((*launches)[0]->data == std::vector<const void*>{device_pointer(0), device_pointer(1), device_pointer(2)});
  CHECK((*launches)[0]->as.orders == std::vector<std::int64_t>{2, 1, 0});
}

TEST_CASE("gradients on several devices and streams get one launch each, host ones none", "[session]") {
  FakeDeviceRun run(4);
  agent::Session& s = run.session;
  const auto& launches = run.launches;
  std::vector<float> host(8, 1.0f);
  int stream_a = 0, stream_b = 0;
  const std::int64_t ids[] = {0, 1, 2, 3};
  const DeviceTensor t[] = {{{device_pointer(0), 8, kernels::DType::kFloat16}, kGpu0, &stream_a},
                            {{host.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{device_pointer(2), 8, kernels::DType::kFloat32}, {DeviceType::kCuda, 1}, &stream_b},
                            {{device_pointer(3), 8, kernels::DType::kFloat32}, kGpu0, &stream_a}};
  agent::GradBatch b;
  b.layers = ids;
  b.tensors = t;
  b.count = 4;
  s.begin_cycle();
  s.grads(b);
  REQUIRE(launches->size() == 2);
  CHECK((*launches)[0]->as.ids == std::vector<std::int64_t>{0, 3});
  CHECK((*launches)[0]->launch.stream == &stream_a);
  CHECK((*launches)[1]->as.ids == std::vector<std::int64_t>{2});
  CHECK((*launches)[1]->launch.device.index == 1);
}

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

TEST_CASE("with histograms on, a host activation's exponent histogram counts its values' binades", "[session]") {
  TempDir dir;
  agent::SessionOptions o = options();
  o.histogram = true;
  const std::vector<float> values = {0.5f, 0.75f, 3.0f, 3.5f, 1e-20f, 0.0f, 70000.0f, -4.0f};
  {
    agent::Session s(o);
    open_with_layers(s, dir.file("run.db"), 1);
    s.begin_cycle();
    const auto m = s.module_id("enc", "Linear", "", "");
    s.activation(m, {{values.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0);
    s.end_step({}, 0);
    s.close();
  }
  // Directly: bin 0 below 2^kHistMinExp, bin 1 + (e - kHistMinExp) for 2^e <= |x| < 2^(e+1).
  std::vector<std::uint32_t> expected(rundb::kHistBins, 0);
  for (const float v : values) {
    if (v == 0.0f) continue;
    const int e = std::ilogb(v);
    expected[e < rundb::kHistMinExp ? 0 : std::size_t(1 + e - rundb::kHistMinExp)] += 1;
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 1);
  CHECK(acts[0].histogram == expected);
}

TEST_CASE("between full activation steps a host output is only checked: a row only when it holds NaN/Inf",
          "[session]") {
  TempDir dir;
  agent::SessionOptions o = options();
  o.recorder.every = 2;
  o.activation_every = 2;  // full statistics on steps 0, 4, 8, ...
  const std::vector<float> finite(8, 2.0f);
  std::vector<float> overflowed(8, 3.0f);
  overflowed[5] = std::numeric_limits<float>::infinity();
  std::vector<bool> reported;
  {
    agent::Session s(o);
    open_with_layers(s, dir.file("run.db"), 1);
    const auto m = s.module_id("enc", "Linear", "", "");
    for (int step = 0; step < 5; ++step) {
      s.begin_cycle();
      reported.push_back(s.activation(m, {{finite.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0));
      reported.push_back(s.activation(m, {{overflowed.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0));
      s.end_step({}, 0);
    }
    s.close();
  }
  CHECK(reported == std::vector<bool>{false, true, false, true, false, true, false, true, false, true});
  rundb::RunDbReader r(dir.file("run.db"));
  std::vector<std::pair<std::int64_t, std::int64_t>> rows;  // (step, fwd_order)
  for (const auto& a : r.act_stats()) {
    rows.push_back({a.step, a.fwd_order});
    CHECK(a.stats.absmax == (a.fwd_order == 0 ? 2.0f : 3.0f));  // full statistics, also for a checked one
  }
  // Steps 0 and 4: both outputs; step 2 (recorded, not full): the overflowed one only, at
  // its own forward position; odd steps are not recorded (every = 2).
  const std::vector<std::pair<std::int64_t, std::int64_t>> want = {{0, 0}, {0, 1}, {2, 1}, {4, 0}, {4, 1}};
  CHECK(rows == want);
}

TEST_CASE("activation_every below 1 is refused", "[session]") {
  agent::SessionOptions o = options();
  o.activation_every = 0;
  CHECK_THROWS_WITH(agent::Session(o), Catch::Contains("activation_every"));
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

TEST_CASE("rows posted before the file opens are written when it opens", "[session][registry]") {
  TempDir dir;
  {
    agent::Session s(options());
    agent::LayerInfo w;
    w.name = "enc.weight";
    w.dtype = "float32";
    const auto first = s.add_layer(1, w);
    CHECK(first.added);
    agent::LayerInfo tied = w;
    tied.name = "dec.weight";
    const auto again = s.add_layer(1, tied);  // the same tensor: the first id
    CHECK(again.id == first.id);
    CHECK_FALSE(again.added);
    agent::LayerInfo frozen = w;
    frozen.name = "emb.weight";
    frozen.trainable = false;
    s.add_layer(2, frozen);
    s.layers_done();
    s.module_id("enc", "Linear", "", "");
    agent::RunMeta m;
    m.source = "test";
    m.scaler_init_scale = 65536.0;
    m.scaler_growth_factor = 2.0;
    m.scaler_backoff_factor = 0.5;
    m.scaler_growth_interval = 2000;
    s.write_meta(m);
    CHECK(s.layer_of(3, w).id == 2);  // an optimized tensor the model does not hold
    s.open(dir.file("run.db"), {1, 4}, "");
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto layers = r.layers();
  REQUIRE(layers.size() == 3);
  CHECK(layers[2].name == "optimizer.param2");
  CHECK(r.modules().size() == 1);
  auto meta = r.meta();
  CHECK(meta["rank"] == "1");
  CHECK(meta["world_size"] == "4");
  CHECK(!meta["run_id"].empty());
  CHECK(meta["scaler_init_scale"] == "65536");
  CHECK(meta["scaler_backoff_factor"] == "0.5");
  std::vector<std::string> kinds;
  for (const auto& e : r.events()) kinds.push_back(e.kind);
  std::sort(kinds.begin(), kinds.end());
  CHECK(kinds == std::vector<std::string>{"foreign-parameter", "frozen-parameters", "shared-parameter"});
}

TEST_CASE("without a device engine, device tensors get a one-time event and no statistics", "[session]") {
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 1);
  const auto real = agent::make_cuda_engine();
  if (real && real->unavailable().empty()) return;  // a real device would run the (bogus) pointers
  device_cycle(s, 1);
  device_cycle(s, 1);
  s.close();
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK(r.grad_stats().empty());
  int events = 0;
  for (const auto& e : r.events()) events += e.kind == "slow-path" ? 1 : 0;
  CHECK(events == 1);
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
