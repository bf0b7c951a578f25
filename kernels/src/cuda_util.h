// What every CUDA unit of kernels/ needs: errors as exceptions, and running on a given
// device without changing the caller's current device.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "ampdiag/kernels/cuda_stats.h"

#define AMPDIAG_CUDA_CHECK(expr)                                                                        \
  do {                                                                                                  \
    const cudaError_t ampdiag_err = (expr);                                                             \
    if (ampdiag_err != cudaSuccess)                                                                     \
      throw std::runtime_error(std::string("CUDA: ") + #expr + ": " + cudaGetErrorString(ampdiag_err)); \
  } while (0)

namespace ampdiag::kernels {

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    AMPDIAG_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) AMPDIAG_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceScope() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0, device_ = 0;
};

// Non-blocking: has the work recorded before `done` finished? Clears `in_flight` once it has
// (a slot never recorded is done).
inline bool event_passed(cudaEvent_t done, bool& in_flight) {
  if (!in_flight) return true;
  const cudaError_t status = cudaEventQuery(done);
  if (status == cudaErrorNotReady) return false;
  AMPDIAG_CUDA_CHECK(status);
  in_flight = false;
  return true;
}

// The checks every pool of device slots makes on its arguments; `who` names it.
inline void check_slot_pool(const char* who, int slots, int device) {
  if (slots < 1) throw std::invalid_argument(std::string(who) + ": slots must be >= 1, not " + std::to_string(slots));
  if (!cuda_device_available())
    throw std::runtime_error(std::string(who) + ": no CUDA device (" + cuda_unavailable_reason() + ")");
  int devices = 0;
  AMPDIAG_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (device < 0 || device >= devices)
    throw std::invalid_argument(std::string(who) + ": device " + std::to_string(device) + " does not exist (" +
                                std::to_string(devices) + " devices)");
}

}  // namespace ampdiag::kernels
