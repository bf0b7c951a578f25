// The shared element math on its own: the fp16/bf16 conversions against the compiler's,
// and the vector instantiation against the scalar one that CUDA threads run.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>

#include "ampdiag/kernels/element_math.h"
#include "reference_stats.h"

using namespace ampdiag;
using namespace ampdiag::kernels;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::uint16_t compiler_f16_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

}  // namespace

TEST_CASE("fp16 widening is exact for every bit pattern", "[math]") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    _Float16 x;
    const std::uint16_t h16 = std::uint16_t(h);
    std::memcpy(&x, &h16, 2);
    const std::uint32_t want = bits_of(static_cast<float>(x));
    const std::uint32_t got = math::f16_to_f32_bits(h);
    INFO("fp16 bits " << std::hex << h);
    if ((h & 0x7fffu) > 0x7c00u) {
      // NaN: same sign and payload; the compiler's conversion also sets the quiet bit.
      REQUIRE((got | 0x00400000u) == want);
    } else {
      REQUIRE(got == want);
    }
  }
}

TEST_CASE("fp16 narrowing rounds to nearest even like a cast", "[math]") {
  std::vector<float> values = {0.0f,      -0.0f,     1.0f,      65504.0f,  65519.99f, 65520.0f, -65520.0f,
                               1e10f,     5.96e-8f,  2.98e-8f,  2.99e-8f,  6.1e-5f,   6.09e-5f, 1e-30f,
                               1.0009765625f, 1.00048828125f, 1.00146484375f, std::numeric_limits<float>::infinity()};
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = any(rng);
    float f;
    std::memcpy(&f, &u, 4);
    values.push_back(f);
  }
  for (float f : values) {
    INFO("fp32 bits " << std::hex << bits_of(f));
    const std::uint32_t got = math::f32_to_f16_bits(bits_of(f));
    const std::uint16_t want = compiler_f16_bits(f);
    if ((bits_of(f) & 0x7fffffffu) > 0x7f800000u)
      REQUIRE(got == (((bits_of(f) >> 16) & 0x8000u) | 0x7e00u | ((bits_of(f) >> 13) & 0x3ffu)));
    else
      REQUIRE(got == want);
  }
}

TEST_CASE("bf16 narrowing rounds to nearest even and canonicalises NaN", "[math]") {
  CHECK(math::f32_to_bf16_bits(0x3f808000u) == 0x3f80u);  // tie, even stays
  CHECK(math::f32_to_bf16_bits(0x3f818000u) == 0x3f82u);  // tie, odd rounds up
  CHECK(math::f32_to_bf16_bits(0x3f808001u) == 0x3f81u);  // above the tie
  CHECK(math::f32_to_bf16_bits(0x7f7fffffu) == 0x7f80u);  // max float rounds to Inf
  CHECK(math::f32_to_bf16_bits(0xff800000u) == 0xff80u);  // -Inf stays
  CHECK(math::f32_to_bf16_bits(0x7fa00001u) == 0x7fc0u);  // NaN
  CHECK(math::f32_to_bf16_bits(0x00000001u) == 0x0000u);  // smallest subnormal rounds to 0
}

#if !defined(__CUDACC__)
TEST_CASE("vector lanes compute what the scalar path computes", "[math]") {
  std::mt19937 rng(5);
  std::uniform_int_distribution<std::uint32_t> any;
  math::Accumulator<math::u32x8, math::SquareSum8> wide;
  math::ScalarAccumulator scalar;
  wide.reset();
  scalar.reset();
  for (int i = 0; i < 10000; ++i) {
    math::u32x8 v;
    for (int l = 0; l < 8; ++l) {
      v[l] = any(rng);
      scalar.add(v[l]);
    }
    wide.add(v);
    const math::u32x8 narrowed = math::f32_to_f16_bits(v);
    const math::u32x8 widened = math::f16_to_f32_bits(v & 0xffffu);
    for (int l = 0; l < 8; ++l) {
      REQUIRE(narrowed[l] == math::f32_to_f16_bits(std::uint32_t(v[l])));
      REQUIRE(widened[l] == math::f16_to_f32_bits(std::uint32_t(v[l] & 0xffffu)));
    }
  }
  math::Partial a, b;
  a.reset();
  b.reset();
  math::fold(wide, a);
  math::fold(scalar, b);
  REQUIRE(a.nan == b.nan);
  REQUIRE(a.inf == b.inf);
  REQUIRE(a.zeros == b.zeros);
  REQUIRE(a.subnormal == b.subnormal);
  REQUIRE(a.max_bits == b.max_bits);
  REQUIRE(a.min_nz_bits == b.min_nz_bits);
  REQUIRE(a.sumsq == Approx(b.sumsq).epsilon(1e-12));
}
#endif
