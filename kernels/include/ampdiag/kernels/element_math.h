// The per-element math of the gradient statistics and the fused unscale, shared by the
// CPU kernels (compiled per SIMD target) and the CUDA kernels: the logic exists once.
//
// Everything works on fp32 bit patterns: fp16 and bf16 inputs are widened exactly
// first, so NaN/Inf/zero/subnormal tests are integer compares, abs is a mask, and
// max/min of |x| are unsigned integer max/min (the order of non-negative IEEE floats
// is the order of their bit patterns). The code is branch-free.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ampdiag/kernels/tensor_stats.h"

#if defined(__CUDACC__)
#define AMPDIAG_HD __host__ __device__ __forceinline__
#else
#define AMPDIAG_HD inline __attribute__((always_inline))
#endif

namespace ampdiag::kernels::math {

constexpr std::uint32_t kAbsMask = 0x7fffffffu;
constexpr std::uint32_t kInfBits = 0x7f800000u;
constexpr std::uint32_t kFp16MinNormalBits = 0x38800000u;  // 2^-14 as fp32
constexpr std::uint32_t kNoMinBits = 0xffffffffu;          // "no finite non-zero value yet"

// --- the lane types -------------------------------------------------------------------
// The math below is written once, as templates over U: the fp32 bit patterns of one value
// (std::uint32_t: a CUDA thread, the CPU's loop tails) or of N values (u32xN, a GCC vector
// the CPU kernels use). These overloads are all the lane types differ in.

AMPDIAG_HD float to_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

AMPDIAG_HD std::uint32_t from_float(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

AMPDIAG_HD std::uint32_t mask(bool cond) { return 0u - std::uint32_t(cond); }  // all ones or zero
AMPDIAG_HD bool any_lane(std::uint32_t m) { return m != 0u; }
AMPDIAG_HD float int_to_float(std::uint32_t v) { return float(v); }

AMPDIAG_HD void add_squares(double& sum, float f) {
  const double v = double(f);  // |x| < 2^128: x*x < 2^256 neither overflows nor rounds in double
  sum += v * v;
}

#if !defined(__CUDACC__)
// One vector width per instruction set (SSE2: 4 lanes, AVX2: 8, AVX-512: 16), so that
// every accumulator stays in one register; the sum of squares needs two registers of
// doubles, `lo` and `hi`.
#define AMPDIAG_DEFINE_LANES(N)                                                                   \
  typedef std::uint32_t u32x##N __attribute__((vector_size(4 * N)));                              \
  typedef std::int32_t i32x##N __attribute__((vector_size(4 * N)));                               \
  typedef float f32x##N __attribute__((vector_size(4 * N)));                                      \
  typedef double f64x##N##_half __attribute__((vector_size(4 * N)));                              \
  typedef std::uint16_t u16x##N __attribute__((vector_size(2 * N)));                              \
  struct SquareSum##N {                                                                           \
    f64x##N##_half lo, hi;                                                                        \
    AMPDIAG_HD SquareSum##N& operator+=(const SquareSum##N& o) {                                  \
      lo += o.lo;                                                                                 \
      hi += o.hi;                                                                                 \
      return *this;                                                                               \
    }                                                                                             \
  };                                                                                              \
  AMPDIAG_HD bool any_lane(u32x##N m) {                                                           \
    std::uint32_t any = 0;                                                                        \
    for (int l = 0; l < N; ++l) any |= m[l];                                                      \
    return any != 0;                                                                              \
  }                                                                                               \
  AMPDIAG_HD f32x##N to_float(u32x##N bits) { return reinterpret_cast<f32x##N>(bits); }          \
  AMPDIAG_HD u32x##N from_float(f32x##N f) { return reinterpret_cast<u32x##N>(f); }              \
  AMPDIAG_HD u32x##N mask(i32x##N cond) { return reinterpret_cast<u32x##N>(cond); }              \
  /* Through int32: every ISA has the signed conversion; the values here are < 2^10. */           \
  AMPDIAG_HD f32x##N int_to_float(u32x##N v) {                                                    \
    return __builtin_convertvector(reinterpret_cast<i32x##N>(v), f32x##N);                        \
  }

AMPDIAG_DEFINE_LANES(4)
AMPDIAG_DEFINE_LANES(8)
AMPDIAG_DEFINE_LANES(16)
#undef AMPDIAG_DEFINE_LANES

// Widens each half of f to doubles; the halves come out of memory-free reinterpretation.
template <class F, class Half, class Sum>
AMPDIAG_HD void add_square_halves(Sum& sum, F f) {
  Half halves[2];
  std::memcpy(halves, &f, sizeof f);
  const auto lo = __builtin_convertvector(halves[0], decltype(sum.lo));
  const auto hi = __builtin_convertvector(halves[1], decltype(sum.hi));
  sum.lo += lo * lo;
  sum.hi += hi * hi;
}
typedef float f32x2 __attribute__((vector_size(8)));
AMPDIAG_HD void add_squares(SquareSum4& sum, f32x4 f) { add_square_halves<f32x4, f32x2>(sum, f); }
AMPDIAG_HD void add_squares(SquareSum8& sum, f32x8 f) { add_square_halves<f32x8, f32x4>(sum, f); }
AMPDIAG_HD void add_squares(SquareSum16& sum, f32x16 f) { add_square_halves<f32x16, f32x8>(sum, f); }
#endif

// Bitwise select: GCC will not if-convert `c ? a : b` when an arm feeds floating-point
// math (it might trap), and a branch would stop the CPU loop from vectorizing.
template <class U>
AMPDIAG_HD U select(U m, U a, U b) { return b ^ ((a ^ b) & m); }
// Integer arms only, so a plain conditional is safe; on vectors it is GCC's elementwise
// one and becomes vpmaxud / vpminud.
template <class U>
AMPDIAG_HD U umax(U a, U b) { return a > b ? a : b; }
template <class U>
AMPDIAG_HD U umin(U a, U b) { return a < b ? a : b; }
template <class U>
AMPDIAG_HD U broadcast(std::uint32_t v) { return U{} + v; }

// --- exact widening to fp32 -----------------------------------------------------------

// h holds bf16 / fp16 bit patterns in its low 16 bits.
template <class U>
AMPDIAG_HD U bf16_to_f32_bits(U h) { return h << 16; }

template <class U>
AMPDIAG_HD U f16_to_f32_bits(U h) {
  const U sign = (h & 0x8000u) << 16;
  const U em = h & 0x7fffu;  // exponent and mantissa
  const U mant = em & 0x3ffu;
  // Normal numbers: rebias the exponent from 15 to 127.
  const U normal = (em << 13) + ((127u - 15u) << 23);
  // Inf and NaN keep an all-ones exponent and their payload.
  const U special = (mant << 13) | kInfBits;
  // Zero and subnormals are mant * 2^-24, which fp32 holds exactly.
  const U tiny = from_float(int_to_float(mant) * 5.9604644775390625e-8f);
  return sign | select(mask(em >= 0x7c00u), special, select(mask(em < 0x0400u), tiny, normal));
}

// --- narrowing with round-to-nearest-even, as torch's CPU kernels store -----------------

// From fp32 bits u to fp16 bits. NaN stays NaN with its sign and the top of its payload,
// quietened (as F16C's vcvtps2ph, which torch's vectorized CPU path uses).
template <class U>
AMPDIAG_HD U f32_to_f16_bits(U u) {
  const U sign = (u >> 16) & 0x8000u;
  const U a = u & kAbsMask;
  const U nan = ((a >> 13) & 0x3ffu) | 0x7e00u;
  // Below 2^-14 the result is subnormal: adding 0.5f puts the fp32 ulp at 2^-24, fp16's
  // subnormal step, so the hardware add rounds to nearest even for us.
  const U sub = from_float(to_float(a) + 0.5f) - 0x3f000000u;
  const U odd = (a >> 13) & 1u;
  const U normal = (a + 0xc8000fffu + odd) >> 13;  // rebias 127 -> 15 and round
  // 65520 and above round to Inf (65504 has an odd mantissa, so the tie goes up).
  const U mag = select(mask(a > kInfBits), nan,
                       select(mask(a >= 0x477ff000u), broadcast<U>(0x7c00u),
                              select(mask(a < kFp16MinNormalBits), sub, normal)));
  return sign | mag;
}

// From fp32 bits to bf16 bits. NaN becomes the canonical quiet NaN 0x7fc0 (as
// c10::BFloat16's conversion; torch's vectorized CPU path writes 0xffff instead).
template <class U>
AMPDIAG_HD U f32_to_bf16_bits(U u) {
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return select(mask((u & kAbsMask) > kInfBits), broadcast<U>(0x7fc0u), rounded);
}

// The bits torch._amp_foreach_non_finite_check_and_unscale_ computes (in fp32) for the
// value with bits u: u itself when inv_scale is 1 (v * 1 would quieten a signalling NaN).
template <class U>
AMPDIAG_HD U unscale_bits(U u, float inv_scale) {
  return inv_scale == 1.0f ? u : from_float(to_float(u) * inv_scale);
}

// --- scalar load and store by dtype (CUDA threads, CPU tails) --------------------------

template <DType D>
AMPDIAG_HD std::uint32_t load_f32_bits(const void* base, std::int64_t i) {
#if defined(__CUDA_ARCH__)
  if constexpr (D == DType::kFloat32) return static_cast<const std::uint32_t*>(base)[i];
  const std::uint32_t h = static_cast<const std::uint16_t*>(base)[i];
#else
  // memcpy: the CPU path accepts unaligned tensors; it compiles to a plain load.
  if constexpr (D == DType::kFloat32) {
    std::uint32_t v;
    std::memcpy(&v, static_cast<const char*>(base) + 4 * i, 4);
    return v;
  }
  std::uint16_t h16;
  std::memcpy(&h16, static_cast<const char*>(base) + 2 * i, 2);
  const std::uint32_t h = h16;
#endif
  if constexpr (D == DType::kFloat16) return f16_to_f32_bits(h);
  return bf16_to_f32_bits(h);
}

// Stores the value with fp32 bits u as dtype D.
template <DType D>
AMPDIAG_HD void store_f32_bits(void* base, std::int64_t i, std::uint32_t u) {
  if constexpr (D == DType::kFloat32) {
#if defined(__CUDA_ARCH__)
    static_cast<std::uint32_t*>(base)[i] = u;
#else
    std::memcpy(static_cast<char*>(base) + 4 * i, &u, 4);
#endif
    return;
  }
  const std::uint16_t h = std::uint16_t(D == DType::kFloat16 ? f32_to_f16_bits(u) : f32_to_bf16_bits(u));
#if defined(__CUDA_ARCH__)
  static_cast<std::uint16_t*>(base)[i] = h;
#else
  std::memcpy(static_cast<char*>(base) + 2 * i, &h, 2);
#endif
}

// --- the statistics -------------------------------------------------------------------

// Combinable partial statistics of a run of elements.
struct Partial {
  std::int64_t nan, inf, zeros, subnormal;
  std::uint32_t max_bits;     // of |x| over finite x
  std::uint32_t min_nz_bits;  // of |x| over finite non-zero x, kNoMinBits if none
  double sumsq;               // of finite x

  AMPDIAG_HD void reset() {
    nan = inf = zeros = subnormal = 0;
    max_bits = 0;
    min_nz_bits = kNoMinBits;
    sumsq = 0.0;
  }

  // Merge order matters only for sumsq; callers merge in a fixed order to be deterministic.
  AMPDIAG_HD void merge(const Partial& o) {
    nan += o.nan;
    inf += o.inf;
    zeros += o.zeros;
    subnormal += o.subnormal;
    max_bits = umax(max_bits, o.max_bits);
    min_nz_bits = umin(min_nz_bits, o.min_nz_bits);
    sumsq += o.sumsq;
  }
};

// Running statistics of one lane type U (see above) with its sum-of-squares state S. The
// counters are 32-bit: fold into a Partial before a lane has seen 2^32 elements.
template <class U, class S>
struct Accumulator {
  U max_bits, min_nz_bits, nan, inf, zeros, subnormal;
  S sumsq;

  AMPDIAG_HD void reset() {
    max_bits = nan = inf = zeros = subnormal = U{};
    min_nz_bits = broadcast<U>(kNoMinBits);
    sumsq = S{};
  }

  // The per-element statistics of the values with fp32 bits `bits`.
  //
  // kAssumeFinite skips the NaN/Inf classification, which real gradients almost never
  // need: the result is then only valid if saw_nonfinite() stays false, and a caller that
  // finds it true must run the same values again without the assumption.
  template <bool kAssumeFinite = false>
  AMPDIAG_HD void add(U bits) {
    const U a = bits & kAbsMask;
    U finite_abs = a;
    if constexpr (!kAssumeFinite) {
      finite_abs = a & mask(a < kInfBits);
      // A true mask is all ones, -1: subtracting it counts one.
      nan -= mask(a > kInfBits);
      inf -= mask(a == kInfBits);
    }
    max_bits = umax(max_bits, finite_abs);
    min_nz_bits = umin(min_nz_bits, finite_abs | mask(finite_abs == 0u));
    zeros -= mask(a == 0u);
    // Unsigned wrap-around: a - 1 < limit - 1 is 0 < a < limit.
    subnormal -= mask(a - 1u < kFp16MinNormalBits - 1u);
    add_squares(sumsq, to_float(finite_abs));
  }

  // After add<true>: whether a NaN or Inf went by (the max then holds its bits).
  AMPDIAG_HD bool saw_nonfinite() const { return any_lane(mask(max_bits >= kInfBits)); }

  AMPDIAG_HD void merge(const Accumulator& o) {
    max_bits = umax(max_bits, o.max_bits);
    min_nz_bits = umin(min_nz_bits, o.min_nz_bits);
    nan += o.nan;
    inf += o.inf;
    zeros += o.zeros;
    subnormal += o.subnormal;
    sumsq += o.sumsq;
  }
};

using ScalarAccumulator = Accumulator<std::uint32_t, double>;

AMPDIAG_HD void fold(const ScalarAccumulator& acc, Partial& p) {
  p.nan += acc.nan;
  p.inf += acc.inf;
  p.zeros += acc.zeros;
  p.subnormal += acc.subnormal;
  p.max_bits = umax(p.max_bits, acc.max_bits);
  p.min_nz_bits = umin(p.min_nz_bits, acc.min_nz_bits);
  p.sumsq += acc.sumsq;
}

#if !defined(__CUDACC__)
template <class U, class S>
inline void fold(const Accumulator<U, S>& acc, Partial& p) {
  constexpr int kLanes = int(sizeof(U) / 4);
  for (int l = 0; l < kLanes; ++l) {
    p.nan += acc.nan[l];
    p.inf += acc.inf[l];
    p.zeros += acc.zeros[l];
    p.subnormal += acc.subnormal[l];
    p.max_bits = umax(p.max_bits, std::uint32_t(acc.max_bits[l]));
    p.min_nz_bits = umin(p.min_nz_bits, std::uint32_t(acc.min_nz_bits[l]));
  }
  for (int l = 0; l < kLanes / 2; ++l) p.sumsq += acc.sumsq.lo[l] + acc.sumsq.hi[l];
}
#endif

// Exponent-histogram bin (see kHistBins) of a finite non-zero |x| given as fp32 bits;
// -1 for zero and non-finite values, which the histogram does not count.
AMPDIAG_HD int hist_bin(std::uint32_t bits) {
  const std::uint32_t a = bits & kAbsMask;
  if (a == 0u || a >= kInfBits) return -1;
  const int e = int(a >> 23) - 127;  // fp32 subnormals give -127: the underflow bin
  if (e < kHistMinExp) return 0;
  if (e > kHistMaxExp) return kHistBins - 1;
  return 1 + e - kHistMinExp;
}

AMPDIAG_HD void finalize(const Partial& p, std::int64_t numel, TensorStats& out) {
  out.numel = numel;
  out.nan = p.nan;
  out.inf = p.inf;
  out.zeros = p.zeros;
  out.fp16_subnormal = p.subnormal;
  out.absmax = to_float(p.max_bits);
  out.amin_nz = p.min_nz_bits == kNoMinBits ? 0.0f : to_float(p.min_nz_bits);
  out.l2 = sqrt(p.sumsq);
}

}  // namespace ampdiag::kernels::math
