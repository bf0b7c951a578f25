// A deliberately plain reference for the kernel tests: one element at a time, through
// the compiler's own _Float16 conversions and <cmath>, sharing no code with kernels/.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "ampdiag/kernels/tensor_stats.h"

namespace ampdiag::test {

using kernels::DType;
using kernels::TensorStats;

// The value of element i of a tensor of dtype `dtype`.
float reference_value(const void* data, std::int64_t i, DType dtype);

TensorStats reference_stats(const void* data, std::int64_t numel, DType dtype);
std::array<std::uint64_t, kernels::kHistBins> reference_histogram(const void* data, std::int64_t numel, DType dtype);

// The bits torch's unscale stores for v * inv_scale (v itself when inv_scale is 1),
// rounded to nearest even into `dtype`; for a NaN result only "is NaN" is meaningful.
std::uint32_t reference_unscaled_bits(float v, float inv_scale, DType dtype);
bool bits_are_nan(std::uint32_t bits, DType dtype);

// Raw element storage of one test tensor.
struct HostTensor {
  DType dtype = DType::kFloat32;
  std::int64_t numel = 0;
  std::vector<unsigned char> bytes;

  const void* data() const { return bytes.data(); }
  void* data() { return bytes.data(); }
  std::uint32_t bits_at(std::int64_t i) const;  // raw stored bits, zero-extended
  void set_value(std::int64_t i, float v);       // rounds to dtype like a cast
};

// What a test tensor holds.
enum class Mix {
  kGradients,  // normal values of gradient size, some exact zeros
  kSpecials,   // gradients plus NaN, +-Inf, -0, fp16 subnormals, huge and tiny values
  kRandomBits  // every bit pattern equally likely (all classes, all NaN payloads)
};

HostTensor make_tensor(DType dtype, std::int64_t numel, Mix mix, std::uint64_t seed);

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

}  // namespace ampdiag::test
