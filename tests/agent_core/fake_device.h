// What the session-core tests of device statistics share: a fake deferred engine whose
// tickets (statistics launches and outcome read-backs) land only when a test says so,
// device tensors pointing at memory no host engine may read (a wrong engine choice would
// crash, not pass), and a session on a fresh file with that engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "session.h"
#include "session_fixture.h"

namespace ampdiag::test {

using agent::Device;
using agent::DeviceTensor;
using agent::DeviceType;

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
inline const void* device_pointer(int k) { return reinterpret_cast<const void*>(std::uintptr_t(0x10) + 0x1000u * unsigned(k)); }

inline DeviceTensor on_gpu(int k) { return {{device_pointer(k), 8, kernels::DType::kFloat32}, kGpu0, nullptr}; }

inline agent::SessionOptions options(std::int64_t max_waiting = 4) { return test::recording_options(max_waiting); }

// Gives the session one host float32 gradient of layer `id`; returns what grads() does.
inline bool host_grad(agent::Session& s, std::int64_t id, const float* data, std::int64_t numel) {
  const DeviceTensor t{{data, numel, kernels::DType::kFloat32}, kCpu, nullptr};
  agent::GradBatch b;
  b.layers = &id;
  b.tensors = &t;
  b.count = 1;
  return s.grads(b);
}

// One optimizer cycle whose gradients (layers 0..n-1) are device tensors; `later`: its
// outcome is read back from the device.
inline void device_cycle(agent::Session& s, int n, double scale = 1024.0, const agent::DeviceOutcome* later = nullptr) {
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
inline agent::DeviceOutcome device_outcome(const double* values, unsigned fields) {
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

inline std::vector<rundb::GradStatRow> grads_of(rundb::RunDbReader& r, std::int64_t step) {
  std::vector<rundb::GradStatRow> out;
  for (const auto& g : r.grad_stats())
    if (g.step == step) out.push_back(g);
  return out;
}

}  // namespace ampdiag::test
