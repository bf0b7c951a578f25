// The plain reference of reference_stats.h.
#include "reference_stats.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

namespace ampdiag::test {
namespace {

float from_bits32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t to_bits32(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Round to nearest even to bf16 by comparing the two neighbours in double.
std::uint16_t reference_to_bf16(float v) {
  if (std::isnan(v)) return 0x7fc0;
  const std::uint32_t u = to_bits32(v);
  const std::uint32_t down = u & 0xffff0000u;
  const std::uint32_t up = down + 0x10000u;  // next bf16 away from zero (may become Inf)
  const double dv = std::fabs(double(v));
  const double ddown = std::fabs(double(from_bits32(down)));
  const double dup = std::isinf(from_bits32(up)) ? std::ldexp(1.0, 128) : std::fabs(double(from_bits32(up)));
  if (dv - ddown < dup - dv) return std::uint16_t(down >> 16);
  if (dv - ddown > dup - dv) return std::uint16_t(up >> 16);
  return ((down >> 16) & 1u) ? std::uint16_t(up >> 16) : std::uint16_t(down >> 16);
}

}  // namespace

std::uint32_t HostTensor::bits_at(std::int64_t i) const {
  if (dtype == DType::kFloat32) {
    std::uint32_t u;
    std::memcpy(&u, bytes.data() + 4 * i, 4);
    return u;
  }
  std::uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return h;
}

void HostTensor::set_value(std::int64_t i, float v) {
  if (dtype == DType::kFloat32) {
    std::memcpy(bytes.data() + 4 * i, &v, 4);
  } else if (dtype == DType::kFloat16) {
    const _Float16 h = static_cast<_Float16>(v);
    std::memcpy(bytes.data() + 2 * i, &h, 2);
  } else {
    const std::uint16_t h = reference_to_bf16(v);
    std::memcpy(bytes.data() + 2 * i, &h, 2);
  }
}

float reference_value(const void* data, std::int64_t i, DType dtype) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  if (dtype == DType::kFloat16) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return static_cast<float>(x);
  }
  return from_bits32(std::uint32_t(h) << 16);
}

TensorStats reference_stats(const void* data, std::int64_t numel, DType dtype) {
  TensorStats s;
  s.numel = numel;
  long double sumsq = 0.0L;
  float min_nz = std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < numel; ++i) {
    const float v = reference_value(data, i, dtype);
    if (std::isnan(v)) {
      ++s.nan;
      continue;
    }
    if (std::isinf(v)) {
      ++s.inf;
      continue;
    }
    const float a = std::fabs(v);
    if (a == 0.0f) {
      ++s.zeros;
    } else {
      if (a < std::ldexp(1.0f, -14)) ++s.fp16_subnormal;
      if (a < min_nz) min_nz = a;
    }
    if (a > s.absmax) s.absmax = a;
    sumsq += (long double)a * (long double)a;
  }
  s.amin_nz = std::isinf(min_nz) ? 0.0f : min_nz;
  s.l2 = double(std::sqrt(sumsq));
  return s;
}

std::array<std::uint64_t, kernels::kHistBins> reference_histogram(const void* data, std::int64_t numel, DType dtype) {
  std::array<std::uint64_t, kernels::kHistBins> h{};
  for (std::int64_t i = 0; i < numel; ++i) {
    const float v = reference_value(data, i, dtype);
    if (std::isnan(v) || std::isinf(v) || v == 0.0f) continue;
    int e = 0;
    std::frexp(std::fabs(v), &e);  // |v| = m * 2^e with m in [0.5, 1): floor(log2|v|) = e - 1
    const int floor_log2 = e - 1;
    if (floor_log2 < kernels::kHistMinExp)
      ++h[0];
    else if (floor_log2 > kernels::kHistMaxExp)
      ++h[kernels::kHistBins - 1];
    else
      ++h[std::size_t(1 + floor_log2 - kernels::kHistMinExp)];
  }
  return h;
}

bool bits_are_nan(std::uint32_t bits, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return (bits & 0x7fffffffu) > 0x7f800000u;
    case DType::kFloat16: return (bits & 0x7fffu) > 0x7c00u;
    case DType::kBFloat16: return (bits & 0x7fffu) > 0x7f80u;
  }
  return false;
}

std::uint32_t reference_unscaled_bits(float v, float inv_scale, DType dtype) {
  const float r = inv_scale == 1.0f ? v : v * inv_scale;
  if (dtype == DType::kFloat32) return to_bits32(r);
  if (dtype == DType::kFloat16) {
    const _Float16 h = static_cast<_Float16>(r);
    std::uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  return reference_to_bf16(r);
}

HostTensor make_tensor(DType dtype, std::int64_t numel, Mix mix, std::uint64_t seed) {
  HostTensor t;
  t.dtype = dtype;
  t.numel = numel;
  t.bytes.resize(std::size_t(numel) * kernels::element_size(dtype));
  std::mt19937_64 rng(seed);
  if (mix == Mix::kRandomBits) {
    for (auto& b : t.bytes) b = static_cast<unsigned char>(rng());
    return t;
  }
  std::normal_distribution<float> grad(0.0f, 1e-3f);
  std::uniform_int_distribution<int> pick(0, 99);
  const float huge = dtype == DType::kFloat16 ? 60000.0f : 3.0e38f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < numel; ++i) {
    float v = grad(rng);
    const int p = pick(rng);
    if (p < 5) v = 0.0f;
    if (mix == Mix::kSpecials) {
      switch (p) {
        case 5: v = nan; break;
        case 6: v = inf; break;
        case 7: v = -inf; break;
        case 8: v = -0.0f; break;
        case 9: v = std::ldexp(1.0f, -15) * (1.0f + grad(rng)); break;  // fp16 subnormal
        case 10: v = -huge; break;
        case 11: v = huge * 0.5f; break;
        case 12: v = 1e-40f; break;  // an fp32 subnormal
        case 13: v = std::ldexp(1.0f, -14); break;  // fp16's smallest normal: not subnormal
        default: break;
      }
    }
    t.set_value(i, v);
  }
  return t;
}

}  // namespace ampdiag::test
