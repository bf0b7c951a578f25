// CudaReadback: pinned slots with an event each, reused only once released and landed.
#include "ampdiag/kernels/cuda_readback.h"

#include <string>

#include "ampdiag/kernels/cuda_stats.h"
#include "cuda_util.h"

namespace ampdiag::kernels {

struct CudaReadback::Slot final : CudaValues {
  cudaEvent_t done = nullptr;
  double* host = nullptr;
  std::size_t value_count = 0;
  bool in_flight = false;
  bool held = false;

  ~Slot() override {
    if (done) {
      cudaEventSynchronize(done);  // the copy must not land in freed memory
      cudaEventDestroy(done);
    }
  }
  bool ready() override {
    if (!in_flight) return true;
    const cudaError_t status = cudaEventQuery(done);
    if (status == cudaErrorNotReady) return false;
    AMPDIAG_CUDA_CHECK(status);
    in_flight = false;
    return true;
  }
  const double* values() const override { return host; }
  std::size_t count() const override { return value_count; }
  void release() override { held = false; }
};

CudaReadback::CudaReadback(int slots, int device) : slot_count_(slots), device_(device) {
  if (slots < 1) throw std::invalid_argument("CudaReadback: slots must be >= 1, not " + std::to_string(slots));
  if (!cuda_device_available())
    throw std::runtime_error("CudaReadback: no CUDA device (" + cuda_unavailable_reason() + ")");
  int devices = 0;
  AMPDIAG_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (device < 0 || device >= devices)
    throw std::invalid_argument("CudaReadback: device " + std::to_string(device) + " does not exist (" +
                                std::to_string(devices) + " devices)");
  const DeviceScope scope(device);
  AMPDIAG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_), std::size_t(slots) * kMaxValues * sizeof(double)));
  slots_ = std::make_unique<Slot[]>(std::size_t(slots));
  for (int s = 0; s < slots; ++s) {
    Slot& slot = slots_[std::size_t(s)];
    slot.host = host_ + std::size_t(s) * kMaxValues;
    AMPDIAG_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
}

CudaReadback::~CudaReadback() {
  slots_.reset();  // waits for copies in flight
  if (host_) cudaFreeHost(host_);
}

CudaValues* CudaReadback::read(const double* device_values, std::size_t count, void* stream) {
  if (count > kMaxValues)
    throw std::invalid_argument("CudaReadback::read: at most " + std::to_string(kMaxValues) + " values, not " +
                                std::to_string(count));
  if (count > 0 && device_values == nullptr) throw std::invalid_argument("CudaReadback::read: values is null");
  Slot* slot = nullptr;
  for (int k = 0; k < slot_count_ && !slot; ++k) {
    Slot& candidate = slots_[std::size_t((next_slot_ + k) % slot_count_)];
    if (!candidate.held && candidate.ready()) slot = &candidate;
  }
  if (!slot) return nullptr;
  next_slot_ = int((slot - slots_.get() + 1) % slot_count_);
  const DeviceScope scope(device_);
  const auto s = static_cast<cudaStream_t>(stream);
  if (count > 0)
    AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->host, device_values, count * sizeof(double), cudaMemcpyDeviceToHost, s));
  AMPDIAG_CUDA_CHECK(cudaEventRecord(slot->done, s));
  slot->in_flight = true;
  slot->held = true;
  slot->value_count = count;
  return slot;
}

}  // namespace ampdiag::kernels
