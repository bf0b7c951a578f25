// One chunk of one tensor, processed by the per-ISA compiled loops of cpu_chunk.cpp.
#pragma once

#include <cstdint>

#include "ampdiag/kernels/cpu_stats.h"
#include "ampdiag/kernels/element_math.h"

namespace ampdiag::kernels {

struct ChunkWork {
  const void* src = nullptr;  // first element of the chunk
  void* dst = nullptr;        // same memory when unscaling in place, else null
  std::int64_t count = 0;
  DType dtype = DType::kFloat32;
  float inv_scale = 1.0f;
  std::uint32_t* histogram = nullptr;  // kHistBins counters to add to, or null
};

// Accumulates the chunk's statistics into `out` (and unscales it when dst is set).
using ChunkFn = void (*)(const ChunkWork& work, math::Partial& out);

// The loop compiled for `isa` (which must be supported and not kAuto).
ChunkFn chunk_fn(CpuIsa isa);

// Whether `count` elements of `dtype` at `src` hold a NaN or Inf (compiled per ISA too).
using NonfiniteFn = bool (*)(const void* src, std::int64_t count, DType dtype);
NonfiniteFn nonfinite_fn(CpuIsa isa);

}  // namespace ampdiag::kernels
