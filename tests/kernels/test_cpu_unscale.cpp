// The fused unscale of the CPU engine: what it writes, what it reports, and that its
// statistics describe the values as they were before the unscale.
#include <catch2/catch.hpp>

#include <cstring>

#include "engine_cases.h"

using namespace ampdiag;
using namespace ampdiag::test;
using kernels::CpuIsa;
using kernels::MutableTensorRef;

namespace {

std::uint32_t stored_bits(const void* data, std::int64_t i, DType dtype) {
  if (dtype == DType::kFloat32) {
    std::uint32_t u;
    std::memcpy(&u, static_cast<const char*>(data) + 4 * i, 4);
    return u;
  }
  std::uint16_t h;
  std::memcpy(&h, static_cast<const char*>(data) + 2 * i, 2);
  return h;
}

// Unscales `data` (a copy of t) and checks every element against the reference.
void check_unscaled(const HostTensor& t, const void* data, float inv_scale) {
  for (std::int64_t i = 0; i < t.numel; ++i) {
    const float before = reference_value(t.data(), i, t.dtype);
    const std::uint32_t want = reference_unscaled_bits(before, inv_scale, t.dtype);
    const std::uint32_t got = stored_bits(data, i, t.dtype);
    INFO("element " << i << " before bits " << std::hex << t.bits_at(i) << " inv " << inv_scale);
    if (bits_are_nan(want, t.dtype))
      REQUIRE(bits_are_nan(got, t.dtype));
    else
      REQUIRE(got == want);
  }
}

}  // namespace

TEST_CASE("unscale writes x * inv_scale rounded to nearest even in every dtype", "[unscale]") {
  for (float inv_scale : {1.0f / 65536.0f, 1.0f / 3.0f, 1.0f}) {
    for (auto isa : supported_isas()) {
      auto engine = make_engine(isa);
      for_each_case([&](const EngineCase& c, const HostTensor& t, void* data) {
        if (c.isa != isa || c.numel > 5000) return;
        INFO(c.describe());
        const MutableTensorRef ref{data, t.numel, t.dtype};
        TensorStats s;
        engine.unscale_and_compute(&ref, 1, inv_scale, &s);
        check_unscaled(t, data, inv_scale);
      });
    }
  }
}

TEST_CASE("unscale of every fp16 and bf16 bit pattern matches the reference", "[unscale]") {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    HostTensor t;
    t.dtype = dtype;
    t.numel = 65536;
    t.bytes.resize(2 * 65536);
    for (std::uint32_t h = 0; h < 65536; ++h) std::memcpy(t.bytes.data() + 2 * h, &h, 2);
    for (float inv_scale : {1.0f / 1024.0f, 0.7f, 3.0f}) {
      for (auto isa : supported_isas()) {
        INFO(kernels::cpu_isa_name(isa) << " " << kernels::dtype_name(dtype));
        HostTensor copy = t;
        auto engine = make_engine(isa);
        const MutableTensorRef ref{copy.data(), copy.numel, copy.dtype};
        TensorStats s;
        engine.unscale_and_compute(&ref, 1, inv_scale, &s);
        check_unscaled(t, copy.data(), inv_scale);
      }
    }
  }
}

TEST_CASE("unscale reports found_inf exactly when a NaN or Inf is present", "[unscale]") {
  auto engine = make_engine(CpuIsa::kAuto);
  for (DType dtype : kAllDTypes) {
    HostTensor clean = make_tensor(dtype, 10000, Mix::kGradients, 7);
    HostTensor dirty = clean;
    const MutableTensorRef clean_ref{clean.data(), clean.numel, clean.dtype};
    TensorStats s;
    REQUIRE_FALSE(engine.unscale_and_compute(&clean_ref, 1, 0.5f, &s));
    for (float special : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      for (std::int64_t where : {std::int64_t(0), std::int64_t(5001), std::int64_t(9999)}) {
        HostTensor copy = dirty;
        copy.set_value(where, special);
        const MutableTensorRef ref{copy.data(), copy.numel, copy.dtype};
        INFO(kernels::dtype_name(dtype) << " special at " << where);
        REQUIRE(engine.unscale_and_compute(&ref, 1, 0.5f, &s));
      }
    }
  }
}

TEST_CASE("unscale statistics describe the values before the unscale", "[unscale]") {
  for (auto isa : supported_isas()) {
    auto engine = make_engine(isa);
    for_each_case([&](const EngineCase& c, const HostTensor& t, void* data) {
      if (c.isa != isa || c.numel > 5000) return;
      INFO(c.describe());
      const MutableTensorRef ref{data, t.numel, t.dtype};
      TensorStats got;
      std::vector<std::uint64_t> hist(kernels::kHistBins);
      engine.unscale_and_compute(&ref, 1, 1.0f / 1024.0f, &got, hist.data());
      const auto want = reference_stats(t.data(), t.numel, t.dtype);
      REQUIRE(got.nan == want.nan);
      REQUIRE(got.inf == want.inf);
      REQUIRE(got.zeros == want.zeros);
      REQUIRE(got.fp16_subnormal == want.fp16_subnormal);
      REQUIRE(got.absmax == want.absmax);
      REQUIRE(got.amin_nz == want.amin_nz);
      REQUIRE(got.l2 == Approx(want.l2).epsilon(1e-12).margin(1e-300));
      const auto want_hist = reference_histogram(t.data(), t.numel, t.dtype);
      REQUIRE(std::equal(hist.begin(), hist.end(), want_hist.begin()));
    });
  }
}
