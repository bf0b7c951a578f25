// The CUDA DeviceEngine: one kernels::CudaStatsEngine per device, created when that
// device's first tensor arrives, so a CPU run never touches the CUDA runtime.
#include <chrono>
#include <map>
#include <stdexcept>
#include <thread>

#include "ampdiag/kernels/cuda_readback.h"
#include "ampdiag/kernels/cuda_stats.h"
#include "device_engine.h"

namespace ampdiag::agent {

namespace {

// Launches that may be held at once per device: a step's gradient groups and activations,
// for as many steps as the recorder lets wait (RecorderOptions::max_waiting).
constexpr int kSlotsPerDevice = 512;
// Outcome read-backs held at once per device: one per step (two with an extra update()),
// for as many steps as may wait.
constexpr int kReadbackSlotsPerDevice = 64;

// A ticket over a slot of a kernels engine (a CudaTicket or CudaValues: ready(), release()).
// The slot is held until the ticket lands or is dropped; a dropped ticket frees its slot
// without waiting: the engine reuses a released slot only once its copy has finished.
template <class Slot>
class SlotTicket : public Ticket {
 public:
  explicit SlotTicket(Slot* slot) : slot_(slot) {}
  ~SlotTicket() override {
    if (slot_ != nullptr) slot_->release();
  }
  bool ready() override { return slot_->ready(); }
  bool wait(std::int64_t timeout_ms) override {
    // CUDA events have no timed wait: poll.
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!slot_->ready()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }
  const char* engine() const override { return "cuda"; }

 protected:
  // After land() has read the results: the slot may be launched into again.
  void landed() {
    slot_->release();
    slot_ = nullptr;
  }
  Slot* slot_;
};

class StatsTicket final : public SlotTicket<kernels::CudaTicket> {
 public:
  StatsTicket(kernels::CudaTicket* ticket, LandAs as) : SlotTicket(ticket), as_(std::move(as)) {}
  void land(StepSink& step) override {
    const kernels::TensorStats* stats = slot_->stats();
    const std::uint64_t* hist = slot_->histograms();
    for (std::size_t i = 0; i < as_.ids.size(); ++i) {
      const std::uint64_t* h = hist ? hist + i * kernels::kHistBins : nullptr;
      if (as_.activation)
        step.act(as_.ids[i], as_.orders[i], stats[i], h, as_.micro_batch);
      else
        step.grad(as_.ids[i], as_.orders[i], stats[i], h);
    }
    landed();
  }

 private:
  LandAs as_;
};

class ReadbackTicket final : public SlotTicket<kernels::CudaValues> {
 public:
  ReadbackTicket(kernels::CudaValues* values, const DeviceOutcome& outcome) : SlotTicket(values), outcome_(outcome) {}
  void land(StepSink& step) override {
    apply_outcome(outcome_, slot_->values(), step.outcome());
    landed();
  }

 private:
  DeviceOutcome outcome_;
};

class CudaEngine final : public DeviceEngine {
 public:
  EngineKind kind() const override { return EngineKind::kCuda; }
  std::string unavailable() const override {
    return kernels::cuda_device_available() ? std::string() : kernels::cuda_unavailable_reason();
  }
  std::unique_ptr<Ticket> launch(const kernels::TensorRef* tensors, std::size_t count, const DeviceLaunch& l,
                                 LandAs as) override {
    auto& engine = engines_[l.device.index];
    if (!engine) engine = std::make_unique<kernels::CudaStatsEngine>(kSlotsPerDevice, l.device.index);
    kernels::CudaLaunch launch;
    launch.stream = l.stream;
    launch.inv_scale = l.inv_scale;
    launch.found_inf = l.found_inf;
    launch.histogram = l.histogram;
    kernels::CudaTicket* ticket = engine->launch(tensors, count, launch);
    if (ticket == nullptr) return nullptr;
    return std::make_unique<StatsTicket>(ticket, std::move(as));
  }
  std::unique_ptr<Ticket> read_outcome(const DeviceOutcome& o) override {
    auto& readback = readbacks_[o.device.index];
    if (!readback) readback = std::make_unique<kernels::CudaReadback>(kReadbackSlotsPerDevice, o.device.index);
    kernels::CudaValues* values = readback->read(o.values, DeviceOutcome::kValues, o.stream);
    if (values == nullptr) return nullptr;
    return std::make_unique<ReadbackTicket>(values, o);
  }

 private:
  std::map<int, std::unique_ptr<kernels::CudaStatsEngine>> engines_;
  std::map<int, std::unique_ptr<kernels::CudaReadback>> readbacks_;
};

}  // namespace

std::unique_ptr<DeviceEngine> make_cuda_engine() { return std::make_unique<CudaEngine>(); }

}  // namespace ampdiag::agent
