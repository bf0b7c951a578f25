// The CUDA engine against the CPU engine on the same data (statistics, histograms and the
// fused unscale). Without a CUDA device this binary prints why and exits 77, which ctest
// reports as skipped.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "ampdiag/kernels/cpu_stats.h"
#include "ampdiag/kernels/cuda_stats.h"
#include "reference_stats.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

struct DeviceCopy {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceCopy(const HostTensor& t) : bytes(t.bytes.size()) {
    REQUIRE(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 4)) == cudaSuccess);
    if (bytes) REQUIRE(cudaMemcpy(ptr, t.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~DeviceCopy() { cudaFree(ptr); }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(bytes);
    if (bytes) REQUIRE(cudaMemcpy(out.data(), ptr, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

std::vector<HostTensor> mixed_tensors() {
  std::vector<HostTensor> tensors;
  const std::int64_t sizes[] = {0, 1, 255, 256, 257, 65535, 65536, 65537, 200003};
  std::uint64_t seed = 5;
  for (DType dtype : kAllDTypes)
    for (std::int64_t n : sizes)
      for (Mix mix : {Mix::kGradients, Mix::kSpecials, Mix::kRandomBits}) tensors.push_back(make_tensor(dtype, n, mix, seed++));
  return tensors;
}

}  // namespace

TEST_CASE("CUDA statistics and histograms equal the CPU engine's", "[cuda]") {
  const auto tensors = mixed_tensors();
  std::vector<std::unique_ptr<DeviceCopy>> device;
  std::vector<kernels::TensorRef> host_refs, device_refs;
  for (const auto& t : tensors) {
    device.push_back(std::make_unique<DeviceCopy>(t));
    host_refs.push_back({t.data(), t.numel, t.dtype});
    device_refs.push_back({device.back()->ptr, t.numel, t.dtype});
  }
  std::vector<TensorStats> want(tensors.size());
  std::vector<std::uint64_t> want_hist(tensors.size() * kernels::kHistBins);
  kernels::CpuStatsEngine cpu;
  cpu.compute(host_refs.data(), host_refs.size(), want.data(), want_hist.data());

  kernels::CudaStatsEngine gpu;
  kernels::CudaLaunch launch;
  launch.histogram = true;
  kernels::CudaTicket* ticket = gpu.launch(device_refs.data(), device_refs.size(), launch);
  REQUIRE(ticket != nullptr);
  ticket->wait();
  REQUIRE(ticket->ready());
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    INFO("tensor " << k << " " << kernels::dtype_name(tensors[k].dtype) << " numel " << tensors[k].numel);
    const TensorStats& got = ticket->stats()[k];
    CHECK(got.numel == want[k].numel);
    CHECK(got.nan == want[k].nan);
    CHECK(got.inf == want[k].inf);
    CHECK(got.zeros == want[k].zeros);
    CHECK(got.fp16_subnormal == want[k].fp16_subnormal);
    CHECK(got.absmax == want[k].absmax);
    CHECK(got.amin_nz == want[k].amin_nz);
    CHECK(got.l2 == Approx(want[k].l2).epsilon(1e-12));
    for (int b = 0; b < kernels::kHistBins; ++b)
      CHECK(ticket->histograms()[k * kernels::kHistBins + b] == want_hist[k * kernels::kHistBins + b]);
  }
}

TEST_CASE("CUDA fused unscale writes what the CPU engine writes and sets found_inf", "[cuda]") {
  const auto tensors = mixed_tensors();
  std::vector<HostTensor> cpu_copies = tensors;
  std::vector<std::unique_ptr<DeviceCopy>> device;
  std::vector<kernels::MutableTensorRef> host_refs;
  std::vector<kernels::TensorRef> device_refs;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    device.push_back(std::make_unique<DeviceCopy>(tensors[k]));
    host_refs.push_back({cpu_copies[k].data(), tensors[k].numel, tensors[k].dtype});
    device_refs.push_back({device.back()->ptr, tensors[k].numel, tensors[k].dtype});
  }
  const float inv = 1.0f / 3.0f;
  std::vector<TensorStats> want(tensors.size());
  kernels::CpuStatsEngine cpu;
  const bool cpu_found_inf = cpu.unscale_and_compute(host_refs.data(), host_refs.size(), inv, want.data());

  float* dev_inv = nullptr;
  float* dev_found = nullptr;
  REQUIRE(cudaMalloc(&dev_inv, sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&dev_found, sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMemcpy(dev_inv, &inv, sizeof inv, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemset(dev_found, 0, sizeof(float)) == cudaSuccess);
  kernels::CudaStatsEngine gpu;
  kernels::CudaLaunch launch;
  launch.inv_scale = dev_inv;
  launch.found_inf = dev_found;
  kernels::CudaTicket* ticket = gpu.launch(device_refs.data(), device_refs.size(), launch);
  REQUIRE(ticket != nullptr);
  ticket->wait();
  float found = 0.0f;
  REQUIRE(cudaMemcpy(&found, dev_found, sizeof found, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK((found == 1.0f) == cpu_found_inf);
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const auto got = device[k]->download();
    for (std::int64_t i = 0; i < tensors[k].numel; ++i) {
      HostTensor g;
      g.dtype = tensors[k].dtype;
      g.bytes = got;
      const std::uint32_t a = g.bits_at(i), b = cpu_copies[k].bits_at(i);
      if (a == b) continue;
      INFO("tensor " << k << " element " << i);
      REQUIRE((bits_are_nan(a, g.dtype) && bits_are_nan(b, g.dtype)));  // NaN payloads may differ
    }
  }
  cudaFree(dev_inv);
  cudaFree(dev_found);
}

TEST_CASE("a slot whose results are held is not launched into until released", "[cuda]") {
  const auto tensors = mixed_tensors();
  DeviceCopy device(tensors[0]);
  const kernels::TensorRef ref{device.ptr, tensors[0].numel, tensors[0].dtype};
  kernels::CudaStatsEngine gpu(1);
  kernels::CudaTicket* first = gpu.launch(&ref, 1, {});
  REQUIRE(first != nullptr);
  first->wait();
  CHECK(gpu.launch(&ref, 1, {}) == nullptr);  // ready, but its results are not consumed yet
  first->release();
  kernels::CudaTicket* second = gpu.launch(&ref, 1, {});
  CHECK(second == first);
  second->wait();
  second->release();
}

TEST_CASE("a training-like launch pattern stops allocating once its slots have grown", "[cuda]") {
  // Per "step": 100 one-tensor launches (activations) and one of many tensors (gradients),
  // whose results are held until the next step's launches are in, as the agent holds them.
  const auto tensors = mixed_tensors();
  std::vector<std::unique_ptr<DeviceCopy>> device;
  std::vector<kernels::TensorRef> all;
  for (const auto& t : tensors) {
    device.push_back(std::make_unique<DeviceCopy>(t));
    all.push_back({device.back()->ptr, t.numel, t.dtype});
  }
  kernels::CudaStatsEngine gpu(512);
  std::vector<kernels::CudaTicket*> held, previous;
  std::size_t after_warm_up = 0;
  for (int step = 0; step < 12; ++step) {
    for (int a = 0; a < 100; ++a) held.push_back(gpu.launch(&all[std::size_t(a) % all.size()], 1, {}));
    held.push_back(gpu.launch(all.data(), all.size(), {}));
    for (kernels::CudaTicket* t : previous) {
      REQUIRE(t != nullptr);
      t->wait();
      t->release();
    }
    previous.swap(held);
    held.clear();
    if (step == 3) after_warm_up = gpu.allocations();
  }
  CHECK(after_warm_up > 0);
  CHECK(gpu.allocations() == after_warm_up);
  for (kernels::CudaTicket* t : previous) {
    t->wait();
    t->release();
  }
}

int main(int argc, char** argv) {
  if (!kernels::cuda_device_available()) {
    std::printf("skipped: no CUDA device (%s)\n", kernels::cuda_unavailable_reason().c_str());
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
