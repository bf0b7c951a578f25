// The grid of inputs the CPU engine tests sweep: every ISA this CPU runs, every dtype,
// sizes around the vector width, block and chunk edges, aligned and unaligned starts.
#pragma once

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "ampdiag/kernels/cpu_stats.h"
#include "reference_stats.h"

namespace ampdiag::test {

// With chunk_elements = 1024 the sweep crosses chunk boundaries at small sizes.
constexpr std::int64_t kTestChunk = 1024;

inline std::vector<kernels::CpuIsa> supported_isas() {
  std::vector<kernels::CpuIsa> isas;
  for (auto isa : {kernels::CpuIsa::kBaseline, kernels::CpuIsa::kAvx2, kernels::CpuIsa::kAvx512})
    if (kernels::cpu_isa_supported(isa)) isas.push_back(isa);
  return isas;
}

inline const std::vector<std::int64_t>& sweep_sizes() {
  static const std::vector<std::int64_t> sizes = {0,    1,    3,    4,    7,    8,    15,   16,   17,   31,
                                                  33,   1023, 1024, 1025, 2047, 2048, 2049, 3079, 4096, 100003};
  return sizes;
}

struct EngineCase {
  kernels::CpuIsa isa;
  DType dtype;
  std::int64_t numel;
  Mix mix;
  std::size_t misalign;  // bytes the data start is shifted by

  std::string describe() const {
    return std::string(kernels::cpu_isa_name(isa)) + " " + kernels::dtype_name(dtype) + " numel=" +
           std::to_string(numel) + " mix=" + std::to_string(int(mix)) + " misalign=" + std::to_string(misalign);
  }
};

// A tensor copied to a buffer whose start is `misalign` bytes off alignment.
struct ShiftedTensor {
  std::vector<unsigned char> storage;
  void* data = nullptr;

  ShiftedTensor(const HostTensor& t, std::size_t misalign) : storage(t.bytes.size() + 128) {
    const auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    const std::size_t to_aligned = (64 - base % 64) % 64;
    data = storage.data() + to_aligned + misalign;
    if (!t.bytes.empty()) std::memcpy(data, t.bytes.data(), t.bytes.size());
  }
};

// Calls fn for every case with the tensor and the data pointer the engine will see.
inline void for_each_case(const std::function<void(const EngineCase&, const HostTensor&, void*)>& fn) {
  std::uint64_t seed = 1;
  for (auto isa : supported_isas())
    for (DType dtype : kAllDTypes)
      for (std::int64_t numel : sweep_sizes())
        for (Mix mix : {Mix::kGradients, Mix::kSpecials, Mix::kRandomBits})
          for (std::size_t misalign : {std::size_t(0), kernels::element_size(dtype) == 4 ? std::size_t(2) : std::size_t(1)}) {
            const HostTensor t = make_tensor(dtype, numel, mix, seed++);
            ShiftedTensor shifted(t, misalign);
            fn(EngineCase{isa, dtype, numel, mix, misalign}, t, shifted.data);
          }
}

inline kernels::CpuStatsEngine make_engine(kernels::CpuIsa isa, int threads = 2) {
  kernels::CpuEngineOptions options;
  options.isa = isa;
  options.threads = threads;
  options.chunk_elements = kTestChunk;
  return kernels::CpuStatsEngine(options);
}

}  // namespace ampdiag::test
