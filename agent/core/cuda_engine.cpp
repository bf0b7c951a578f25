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

// Polls `ready` until it says true or `timeout_ms` passed: CUDA events have no timed wait.
template <class Ready>
bool poll_until(Ready ready, std::int64_t timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

class CudaTicketAdapter final : public Ticket {
 public:
  CudaTicketAdapter(kernels::CudaTicket* ticket, LandAs as) : ticket_(ticket), as_(std::move(as)) {}
  ~CudaTicketAdapter() override {
    // A dropped ticket frees its slot without waiting: the engine reuses a released slot
    // only once its launch has finished.
    if (ticket_ != nullptr) ticket_->release();
  }
  bool ready() override { return ticket_->ready(); }
  bool wait(std::int64_t timeout_ms) override {
    return poll_until([this] { return ticket_->ready(); }, timeout_ms);
  }
  void land(StepSink& step) override {
    const kernels::TensorStats* stats = ticket_->stats();
    const std::uint64_t* hist = ticket_->histograms();
    for (std::size_t i = 0; i < as_.ids.size(); ++i) {
      if (as_.activation)
        step.act(as_.ids[i], as_.orders[i], stats[i], as_.micro_batch);
      else
        step.grad(as_.ids[i], as_.orders[i], stats[i], hist ? hist + i * kernels::kHistBins : nullptr);
    }
    ticket_->release();
    ticket_ = nullptr;
  }
  const char* engine() const override { return "cuda"; }

 private:
  kernels::CudaTicket* ticket_;
  LandAs as_;
};

class ReadbackTicket final : public Ticket {
 public:
  ReadbackTicket(kernels::CudaValues* values, const DeviceOutcome& outcome) : values_(values), outcome_(outcome) {}
  ~ReadbackTicket() override {
    if (values_ != nullptr) values_->release();
  }
  bool ready() override { return values_->ready(); }
  bool wait(std::int64_t timeout_ms) override {
    return poll_until([this] { return values_->ready(); }, timeout_ms);
  }
  void land(StepSink& step) override {
    apply_outcome(outcome_, values_->values(), step.outcome());
    values_->release();
    values_ = nullptr;
  }
  const char* engine() const override { return "cuda"; }

 private:
  kernels::CudaValues* values_;
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
    return std::make_unique<CudaTicketAdapter>(ticket, std::move(as));
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
