// The CUDA gradient-statistics engine: one multi-tensor launch per dtype group, per-block
// partials combined in a fixed order, results copied asynchronously to pinned host
// memory. The caller's thread never synchronises with the device. No CUDA headers here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ampdiag/kernels/tensor_stats.h"

namespace ampdiag::kernels {

// True when the CUDA runtime sees at least one device. Checked once; any runtime error
// (no driver, no device) counts as "no device".
bool cuda_device_available();
// Why cuda_device_available() is false, for a log line; empty when it is true.
std::string cuda_unavailable_reason();

struct CudaLaunch {
  void* stream = nullptr;              // cudaStream_t; null is the default stream
  const float* inv_scale = nullptr;    // device pointer: unscale in place when set
  float* found_inf = nullptr;          // device pointer: set to 1.0f on NaN/Inf, never cleared
  bool histogram = false;
};

// Results of one launch, valid once ready() says so.
class CudaTicket {
 public:
  virtual ~CudaTicket() = default;
  // Non-blocking: has the device finished and the copy to host landed?
  virtual bool ready() = 0;
  // Blocks until ready (tests and shutdown only: never on the training thread's hot path).
  virtual void wait() = 0;
  // Valid after ready(); count entries, and count * kHistBins histogram values if asked.
  virtual const TensorStats* stats() const = 0;
  virtual const std::uint64_t* histograms() const = 0;
  virtual std::size_t count() const = 0;
  // The caller is done with the results: the slot may be launched into again. Until then
  // it is held, even once ready, so results waiting to be recorded are never overwritten.
  virtual void release() = 0;
};

class CudaStatsEngine {
 public:
  // `slots`: launches that may be held at once; each owns its device and pinned buffers.
  // Everything runs on `device`, whatever the calling thread's current device is. Throws
  // std::runtime_error when no device is available.
  explicit CudaStatsEngine(int slots = 4, int device = 0);
  ~CudaStatsEngine();
  CudaStatsEngine(const CudaStatsEngine&) = delete;
  CudaStatsEngine& operator=(const CudaStatsEngine&) = delete;

  // Enqueues the pass over `tensors` (device pointers, element-aligned) on launch.stream.
  // Returns null when every slot is still held: the caller drops this sample. A slot's
  // device and pinned buffers grow on demand (cudaMalloc / cudaMallocHost; freeing the old
  // ones synchronises): that happens on the first launches of a given size, not in steady state.
  // Throws std::invalid_argument for a malformed TensorRef, std::runtime_error on CUDA errors.
  CudaTicket* launch(const TensorRef* tensors, std::size_t count, const CudaLaunch& launch);

  // Device and pinned buffers allocated so far (each may have synchronised the device): a
  // launch takes the smallest free slot whose buffers fit, so in a steady state this stays put.
  std::size_t allocations() const { return allocations_; }

 private:
  struct Slot;
  std::unique_ptr<Slot[]> slots_;
  int slot_count_;
  int device_;
  std::size_t allocations_ = 0;
};

}  // namespace ampdiag::kernels
