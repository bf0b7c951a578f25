// The inputs and outputs of the gradient-statistics kernels: raw tensor views and the
// per-tensor statistics of DESIGN.md ("The statistics"). No torch types, no CUDA types.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ampdiag::kernels {

enum class DType : std::uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr std::size_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType dtype);

// A contiguous tensor as the kernels see it. `data` may be unaligned; it may be null
// only when `numel` is 0.
struct TensorRef {
  const void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// The same for the fused unscale, which rewrites the tensor in place.
struct MutableTensorRef {
  void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// Exponent histogram of the finite non-zero values: bin 0 counts |x| < 2^kHistMinExp,
// bin 1 + (e - kHistMinExp) counts 2^e <= |x| < 2^(e+1) for kHistMinExp <= e <= kHistMaxExp,
// and the last bin counts |x| >= 2^(kHistMaxExp + 1).
constexpr int kHistMinExp = -40;
constexpr int kHistMaxExp = 20;
constexpr int kHistBins = (kHistMaxExp - kHistMinExp + 1) + 2;

// Statistics of one tensor, taken on the values as stored (before any unscale).
struct TensorStats {
  std::int64_t numel = 0;
  std::int64_t nan = 0;
  std::int64_t inf = 0;             // +Inf and -Inf
  std::int64_t zeros = 0;           // exact zeros, either sign
  std::int64_t fp16_subnormal = 0;  // finite, non-zero, |x| < 2^-14
  float absmax = 0.0f;              // max |x| over finite x; 0 when none is finite
  float amin_nz = 0.0f;             // min |x| over finite non-zero x; 0 when there is none
  double l2 = 0.0;                  // sqrt(sum x^2) over finite x, accumulated in double

  bool has_nonfinite() const { return nan != 0 || inf != 0; }
};

}  // namespace ampdiag::kernels
