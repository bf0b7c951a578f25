// The CUPTI source itself. Without a driver or device (this machine: no libcuda) start()
// must say so in one line, before touching CUPTI, and nothing after it may fail.
// With a device, a copy inside a pushed range comes back carrying the range's id.
// Run as two ctest tests: "[nodevice]" (here) and "[device]" (exits 77, skipped, here).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "ampdiag/profiler/activity.h"

using namespace ampdiag::profiler;

namespace {

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace

TEST_CASE("without a device CUPTI is unavailable and says why in one line", "[nodevice]") {
  auto source = make_cupti_source();
  const std::string why = source->start();
  INFO(why);
  CHECK_FALSE(why.empty());
  CHECK(why.find('\n') == std::string::npos);
  // Everything after a refused start is harmless.
  source->set_recording(true);
  source->push_range(1);
  source->pop_range();
  ActivityBatch out;
  source->collect(out);
  CHECK(out.empty());
  source->stop();
}

TEST_CASE("on a device a copy inside a range carries the range's external id", "[device]") {
  auto source = make_cupti_source();
  REQUIRE(source->start().empty());
  std::vector<float> host(1 << 16, 1.0f);
  void* device = nullptr;
  REQUIRE(cudaMalloc(&device, host.size() * sizeof(float)) == cudaSuccess);
  source->set_recording(true);
  source->push_range(42);
  REQUIRE(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  source->pop_range();
  source->stop();
  cudaFree(device);
  ActivityBatch out;
  source->collect(out);
  REQUIRE(!out.copies.empty());
  bool tied = false;
  for (const auto& e : out.externals)
    for (const auto& c : out.copies) tied = tied || (e.correlation == c.correlation && e.external_id == 42);
  CHECK(tied);
}

int main(int argc, char** argv) {
  const bool device_run = argc > 1 && std::strcmp(argv[1], "--device") == 0;
  if (device_run != have_device()) {
    std::printf("skipped: %s\n", device_run ? "no CUDA device" : "a CUDA device is present (the device test runs)");
    return 77;
  }
  const char* args[] = {argv[0], device_run ? "[device]" : "[nodevice]"};
  return Catch::Session().run(2, args);
}
