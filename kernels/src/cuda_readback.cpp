// CudaReadback: pinned slots with an event each, reused only once released and landed.
#include "ampdiag/kernels/cuda_readback.h"

#include <string>

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
  bool ready() override { return event_passed(done, in_flight); }
  const double* values() const override { return host; }
  std::size_t count() const override { return value_count; }
  void release() override { held = false; }
};

CudaReadback::CudaReadback(int slots, int device) : slot_count_(slots), device_(device) {
  check_slot_pool("CudaReadback", slots, device);
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
