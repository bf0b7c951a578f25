// The CPU loops over a chunk, compiled once per instruction set from the shared element
// math instantiated for that ISA's native GCC vector; the tail uses the scalar one.
#include "cpu_chunk.h"

#include <immintrin.h>

#include <algorithm>

namespace ampdiag::kernels {
namespace {

// How far ahead of the loads to prefetch. Swept 1-6 KiB on the benchmark machine: 3 KiB
// gave the best ratio to a plain read (0.87 against 0.83 at 2 KiB and 0.68 at 1 KiB).
constexpr std::int64_t kPrefetchBytes = 3072;

}  // namespace
}  // namespace ampdiag::kernels

namespace ampdiag::kernels::math {

// The sum of squares of the AVX2 and AVX-512 variants: the same lanes and the same fused
// multiply-adds as SquareSum8/16 (add_square_halves), with each half widened by one
// vcvtps2pd. GCC lowers the header's __builtin_convertvector of a half to four 128-bit
// conversions and their shuffles, even inside these variants: a third of the AVX-512
// loop. Found through ADL from Accumulator::add; not always_inline, as load_lanes below.
struct WideSquares8 : SquareSum8 {};
__attribute__((target("avx2,fma"))) inline void add_squares(WideSquares8& sum, f32x8 f) {
  const __m256d lo = _mm256_cvtps_pd(reinterpret_cast<__m128>(__builtin_shufflevector(f, f, 0, 1, 2, 3)));
  const __m256d hi = _mm256_cvtps_pd(reinterpret_cast<__m128>(__builtin_shufflevector(f, f, 4, 5, 6, 7)));
  sum.lo += reinterpret_cast<f64x8_half>(lo) * reinterpret_cast<f64x8_half>(lo);
  sum.hi += reinterpret_cast<f64x8_half>(hi) * reinterpret_cast<f64x8_half>(hi);
}

struct WideSquares16 : SquareSum16 {};
__attribute__((target("avx512f"))) inline void add_squares(WideSquares16& sum, f32x16 f) {
  // The zero-masked form with every lane on: the plain one starts from _mm512_undefined_pd,
  // which GCC 12 warns about at every inlining.
  const __mmask8 all = 0xff;
  const __m512d lo = _mm512_maskz_cvtps_pd(all, reinterpret_cast<__m256>(__builtin_shufflevector(f, f, 0, 1, 2, 3, 4, 5, 6, 7)));
  const __m512d hi =
      _mm512_maskz_cvtps_pd(all, reinterpret_cast<__m256>(__builtin_shufflevector(f, f, 8, 9, 10, 11, 12, 13, 14, 15)));
  sum.lo += reinterpret_cast<f64x16_half>(lo) * reinterpret_cast<f64x16_half>(lo);
  sum.hi += reinterpret_cast<f64x16_half>(hi) * reinterpret_cast<f64x16_half>(hi);
}

}  // namespace ampdiag::kernels::math

namespace ampdiag::kernels {
namespace {

// The vector types of one width: L::U holds N lanes of fp32 bits.
template <int N>
struct LanesOf;
#define AMPDIAG_LANES_OF(N, SUM)     \
  template <>                        \
  struct LanesOf<N> {                \
    using U = math::u32x##N;         \
    using U16 = math::u16x##N;       \
    using Sum = math::SUM;           \
  };
AMPDIAG_LANES_OF(4, SquareSum4)
AMPDIAG_LANES_OF(8, WideSquares8)
AMPDIAG_LANES_OF(16, WideSquares16)
#undef AMPDIAG_LANES_OF

template <int N, DType D>
AMPDIAG_HD typename LanesOf<N>::U load_lanes(const void* src, std::int64_t i) {
  using U = typename LanesOf<N>::U;
  if constexpr (D == DType::kFloat32) {
    U v;
    std::memcpy(&v, static_cast<const char*>(src) + 4 * i, sizeof v);
    return v;
  } else {
    typename LanesOf<N>::U16 h;
    std::memcpy(&h, static_cast<const char*>(src) + 2 * i, sizeof h);
    const U wide = __builtin_convertvector(h, U);
    if constexpr (D == DType::kFloat16) return math::f16_to_f32_bits(wide);
    return math::bf16_to_f32_bits(wide);
  }
}

// fp16 loads through F16C's exact vcvtph2ps in the AVX2 and AVX-512 variants: one
// instruction instead of ~12 vector operations (fp16 went at 2.2 G values/s with the
// portable widening). NaN stays NaN (quietened), which is all the statistics and the
// unscale need. Not always_inline: GCC checks targets per call edge, and these can only
// be inlined once the generic loop sits inside the AVX2/AVX-512 variant.
template <>
__attribute__((target("avx2,f16c"))) inline math::u32x8 load_lanes<8, DType::kFloat16>(const void* src, std::int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + 2 * i));
  return reinterpret_cast<math::u32x8>(_mm256_cvtph_ps(h));
}

template <>
__attribute__((target("avx512f,f16c"))) inline math::u32x16 load_lanes<16, DType::kFloat16>(const void* src,
                                                                                           std::int64_t i) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const char*>(src) + 2 * i));
  return reinterpret_cast<math::u32x16>(_mm512_cvtph_ps(h));
}

template <int N, DType D>
AMPDIAG_HD void store_lanes(void* dst, std::int64_t i, typename LanesOf<N>::U bits) {
  if constexpr (D == DType::kFloat32) {
    std::memcpy(static_cast<char*>(dst) + 4 * i, &bits, sizeof bits);
  } else {
    const auto narrow = D == DType::kFloat16 ? math::f32_to_f16_bits(bits) : math::f32_to_bf16_bits(bits);
    const auto h = __builtin_convertvector(narrow, typename LanesOf<N>::U16);
    std::memcpy(static_cast<char*>(dst) + 2 * i, &h, sizeof h);
  }
}

template <DType D>
AMPDIAG_HD void add_histogram(const void* src, std::int64_t count, std::uint32_t* histogram) {
  // Scatter increments do not vectorize. This runs before the main loop, so an in-place
  // unscale has not changed the values yet, and it leaves the chunk in cache.
  for (std::int64_t i = 0; i < count; ++i) {
    const int bin = math::hist_bin(math::load_f32_bits<D>(src, i));
    if (bin >= 0) ++histogram[bin];
  }
}

// Elements per block: small enough to stay in L1 for a redo or the unscale loop.
constexpr std::int64_t kBlock = 2048;

template <int N, DType D, bool kUnscale>
AMPDIAG_HD void chunk_loop(const ChunkWork& work, math::Partial& out) {
  if (work.histogram) add_histogram<D>(work.src, work.count, work.histogram);
  using Acc = math::Accumulator<typename LanesOf<N>::U, typename LanesOf<N>::Sum>;
  const std::int64_t n = work.count;
  const std::int64_t vector_end = n - n % N;
  const char* src = static_cast<const char*>(work.src);
  // In locals: the stores through dst could alias `work`, and GCC then reloads both (and
  // tests the scale against 1) for every vector.
  void* const dst = work.dst;
  const float inv_scale = work.inv_scale;
  Acc total;
  total.reset();
  for (std::int64_t begin = 0; begin < vector_end; begin += kBlock) {
    const std::int64_t end = std::min(begin + kBlock, vector_end);
    Acc block;
    block.reset();
    for (std::int64_t i = begin; i < end; i += N) {
      // The hardware prefetcher alone leaves this loop waiting on memory (measured).
      __builtin_prefetch(src + i * std::int64_t(element_size(D)) + kPrefetchBytes);
      block.template add<true>(load_lanes<N, D>(src, i));
    }
    if (block.saw_nonfinite()) {
      block.reset();
      for (std::int64_t i = begin; i < end; i += N) block.add(load_lanes<N, D>(src, i));
    }
    total.merge(block);
    if constexpr (kUnscale) {
      for (std::int64_t i = begin; i < end; i += N)
        store_lanes<N, D>(dst, i, math::unscale_bits(load_lanes<N, D>(src, i), inv_scale));
    }
  }
  math::ScalarAccumulator tail;
  tail.reset();
  for (std::int64_t i = vector_end; i < n; ++i) {
    const std::uint32_t bits = math::load_f32_bits<D>(src, i);
    tail.add(bits);
    if constexpr (kUnscale) math::store_f32_bits<D>(dst, i, math::unscale_bits(bits, inv_scale));
  }
  math::fold(total, out);
  math::fold(tail, out);
}

template <int N, bool kUnscale>
AMPDIAG_HD void chunk_dispatch(const ChunkWork& work, math::Partial& out) {
  switch (work.dtype) {
    case DType::kFloat32: return chunk_loop<N, DType::kFloat32, kUnscale>(work, out);
    case DType::kFloat16: return chunk_loop<N, DType::kFloat16, kUnscale>(work, out);
    case DType::kBFloat16: return chunk_loop<N, DType::kBFloat16, kUnscale>(work, out);
  }
}

// Each variant inlines the same templates under its own target attribute.
#define AMPDIAG_CHUNK_VARIANT(name, lanes, attributes)              \
  attributes void name(const ChunkWork& work, math::Partial& out) { \
    if (work.dst)                                                    \
      chunk_dispatch<lanes, true>(work, out);                        \
    else                                                             \
      chunk_dispatch<lanes, false>(work, out);                       \
  }

AMPDIAG_CHUNK_VARIANT(chunk_baseline, 4, )
AMPDIAG_CHUNK_VARIANT(chunk_avx2, 8, __attribute__((target("avx2,fma,f16c"))))
AMPDIAG_CHUNK_VARIANT(chunk_avx512, 16, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))))

#undef AMPDIAG_CHUNK_VARIANT

// NaN and Inf have the largest magnitudes as bit patterns: an all-ones exponent. So a
// tensor holds one exactly when the largest of its elements' bits without the sign
// reaches that exponent: an unsigned max over the raw bits, which vectorizes on the 16-bit
// formats' own lanes (32 per AVX-512 instruction) with no widening or classifying.
template <typename Bits>
AMPDIAG_HD bool reaches(const void* src, std::int64_t count, Bits magnitude_mask, Bits exponent) {
  Bits largest = 0;
  const char* p = static_cast<const char*>(src);
  for (std::int64_t i = 0; i < count; ++i) {
    Bits v;
    std::memcpy(&v, p + i * std::int64_t(sizeof v), sizeof v);
    largest = std::max<Bits>(largest, v & magnitude_mask);
  }
  return largest >= exponent;
}

AMPDIAG_HD bool nonfinite_dispatch(const void* src, std::int64_t count, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return reaches<std::uint32_t>(src, count, 0x7fffffffu, 0x7f800000u);
    case DType::kFloat16: return reaches<std::uint16_t>(src, count, 0x7fff, 0x7c00);
    case DType::kBFloat16: return reaches<std::uint16_t>(src, count, 0x7fff, 0x7f80);
  }
  return false;
}

#define AMPDIAG_NONFINITE_VARIANT(name, attributes) \
  attributes bool name(const void* src, std::int64_t count, DType dtype) { return nonfinite_dispatch(src, count, dtype); }

AMPDIAG_NONFINITE_VARIANT(nonfinite_baseline, )
AMPDIAG_NONFINITE_VARIANT(nonfinite_avx2, __attribute__((target("avx2"))))
AMPDIAG_NONFINITE_VARIANT(nonfinite_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2"))))

#undef AMPDIAG_NONFINITE_VARIANT

}  // namespace

NonfiniteFn nonfinite_fn(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return nonfinite_avx512;
    case CpuIsa::kAvx2: return nonfinite_avx2;
    case CpuIsa::kBaseline:
    case CpuIsa::kAuto: break;
  }
  return nonfinite_baseline;
}

ChunkFn chunk_fn(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return chunk_avx512;
    case CpuIsa::kAvx2: return chunk_avx2;
    case CpuIsa::kBaseline:
    case CpuIsa::kAuto: break;
  }
  return chunk_baseline;
}

}  // namespace ampdiag::kernels
