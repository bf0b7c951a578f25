// A handful of device values read back to the host without the caller waiting: a
// non-blocking copy into pinned memory on the producer's stream and an event that says
// when it has landed. The loss scale, found_inf and the loss live on the device in a CUDA
// run; the log needs them, the training thread must not wait for them. No CUDA headers.
#pragma once

#include <cstddef>
#include <memory>

namespace ampdiag::kernels {

// Values of one read, valid once ready() says so.
class CudaValues {
 public:
  virtual ~CudaValues() = default;
  // Non-blocking: has the copy landed?
  virtual bool ready() = 0;
  virtual const double* values() const = 0;
  virtual std::size_t count() const = 0;
  // The caller is done with the values: the slot may be read into again (once its copy
  // has finished, even when it is released before landing).
  virtual void release() = 0;
};

class CudaReadback {
 public:
  static constexpr std::size_t kMaxValues = 8;

  // `slots`: reads that may be held at once. Allocates all pinned memory and events now,
  // on `device`, so that read() never allocates. Throws std::runtime_error when no device
  // is available, std::invalid_argument for a bad slot count or device.
  explicit CudaReadback(int slots = 64, int device = 0);
  ~CudaReadback();
  CudaReadback(const CudaReadback&) = delete;
  CudaReadback& operator=(const CudaReadback&) = delete;

  // Enqueues a copy of `count` doubles (at most kMaxValues) from device memory on `stream`
  // (cudaStream_t; null: the default stream). Null when every slot is held: the caller
  // goes without the values, never waits. Throws std::runtime_error on CUDA errors.
  CudaValues* read(const double* device_values, std::size_t count, void* stream);

 private:
  struct Slot;
  std::unique_ptr<Slot[]> slots_;
  double* host_ = nullptr;  // slots × kMaxValues, pinned
  int slot_count_;
  int device_;
  int next_slot_ = 0;
};

}  // namespace ampdiag::kernels
