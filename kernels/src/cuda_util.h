// What every CUDA unit of kernels/ needs: errors as exceptions, and running on a given
// device without changing the caller's current device.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

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

}  // namespace ampdiag::kernels
