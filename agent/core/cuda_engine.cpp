// The CUDA DeviceEngine: one kernels::CudaStatsEngine per device, created when that
// device's first tensor arrives, so a CPU run never touches the CUDA runtime.
#include <chrono>
#include <map>
#include <stdexcept>
#include <thread>

#include "ampdiag/kernels/cuda_stats.h"
#include "device_engine.h"

namespace ampdiag::agent {

namespace {

// Launches that may be held at once per device: a step's gradient groups and activations,
// for as many steps as the recorder lets wait (RecorderOptions::max_waiting).
constexpr int kSlotsPerDevice = 512;

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
    // CUDA events have no timed wait: poll.
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!ticket_->ready()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
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

 private:
  std::map<int, std::unique_ptr<kernels::CudaStatsEngine>> engines_;
};

}  // namespace

std::unique_ptr<DeviceEngine> make_cuda_engine() { return std::make_unique<CudaEngine>(); }

}  // namespace ampdiag::agent
