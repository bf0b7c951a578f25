// CudaReadback: device values arrive on the host through pinned memory once their event
// has passed, and a held slot is never read into. Runs in kernels_cuda_tests (skipped
// without a device).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include "ampdiag/kernels/cuda_readback.h"

using namespace ampdiag;

namespace {

struct DeviceDoubles {
  double* ptr = nullptr;
  explicit DeviceDoubles(const std::vector<double>& v) {
    REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ptr), v.size() * sizeof(double)) == cudaSuccess);
    REQUIRE(cudaMemcpy(ptr, v.data(), v.size() * sizeof(double), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~DeviceDoubles() { cudaFree(ptr); }
};

void wait_ready(kernels::CudaValues& v) {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(v.ready());
}

}  // namespace

TEST_CASE("read-back values equal the device values once ready", "[cuda]") {
  const std::vector<double> want = {1.5, 65536.0, 32768.0, 1.0};
  DeviceDoubles device(want);
  kernels::CudaReadback readback(2, 0);
  kernels::CudaValues* got = readback.read(device.ptr, want.size(), nullptr);
  REQUIRE(got != nullptr);
  wait_ready(*got);
  REQUIRE(got->count() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(got->values()[i] == want[i]);
  got->release();
}

TEST_CASE("a held read-back slot is not read into until released", "[cuda]") {
  DeviceDoubles device({7.0});
  kernels::CudaReadback readback(1, 0);
  kernels::CudaValues* first = readback.read(device.ptr, 1, nullptr);
  REQUIRE(first != nullptr);
  wait_ready(*first);
  CHECK(readback.read(device.ptr, 1, nullptr) == nullptr);
  first->release();
  CHECK(readback.read(device.ptr, 1, nullptr) != nullptr);
}

TEST_CASE("a read-back of more values than a slot holds is refused", "[cuda]") {
  DeviceDoubles device(std::vector<double>(kernels::CudaReadback::kMaxValues + 1, 0.0));
  kernels::CudaReadback readback(1, 0);
  CHECK_THROWS_AS(readback.read(device.ptr, kernels::CudaReadback::kMaxValues + 1, nullptr), std::invalid_argument);
}
