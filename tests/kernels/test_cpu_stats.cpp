// Each statistic of the CPU engine against the plain reference, over the whole sweep,
// plus the hand-made cases that pin down its definition.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "engine_cases.h"

using namespace ampdiag;
using namespace ampdiag::test;
using kernels::CpuIsa;
using kernels::TensorRef;

namespace {

// Runs the sweep and hands each case's result and the reference's to `check`.
void sweep(const std::function<void(const TensorStats& got, const TensorStats& want)>& check) {
  for (auto isa : supported_isas()) {
    auto engine = make_engine(isa);
    for_each_case([&](const EngineCase& c, const HostTensor& t, void* data) {
      if (c.isa != isa) return;
      INFO(c.describe());
      const TensorRef ref{data, t.numel, t.dtype};
      TensorStats got;
      engine.compute(&ref, 1, &got);
      check(got, reference_stats(t.data(), t.numel, t.dtype));
    });
  }
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TensorStats stats_of(const std::vector<float>& values) {
  auto engine = make_engine(CpuIsa::kAuto, 1);
  const TensorRef ref{values.data(), std::int64_t(values.size()), DType::kFloat32};
  TensorStats s;
  engine.compute(&ref, 1, &s);
  return s;
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("numel is the element count of each tensor", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(got.numel == want.numel); });
}

TEST_CASE("nan counts every NaN, whatever its payload or sign", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(got.nan == want.nan); });
}

TEST_CASE("inf counts both +Inf and -Inf", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(got.inf == want.inf); });
  const auto s = stats_of({kInf, -kInf, 1.0f, kNaN});
  REQUIRE(s.inf == 2);
}

TEST_CASE("zeros counts +0 and -0 only", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(got.zeros == want.zeros); });
  const auto s = stats_of({0.0f, -0.0f, 1e-45f, kNaN});
  REQUIRE(s.zeros == 2);
}

TEST_CASE("absmax is the largest finite magnitude, ignoring NaN and Inf", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(bits(got.absmax) == bits(want.absmax)); });
  REQUIRE(stats_of({1.0f, kInf, kNaN, -3.0f, -kInf}).absmax == 3.0f);
  REQUIRE(stats_of({kInf, kNaN}).absmax == 0.0f);
  REQUIRE(stats_of({}).absmax == 0.0f);
}

TEST_CASE("amin_nz is the smallest finite non-zero magnitude, 0 when there is none", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(bits(got.amin_nz) == bits(want.amin_nz)); });
  REQUIRE(stats_of({0.0f, -0.25f, 0.5f, kNaN, kInf}).amin_nz == 0.25f);
  REQUIRE(stats_of({0.0f, -0.0f, kNaN}).amin_nz == 0.0f);
}

TEST_CASE("fp16_subnormal counts finite non-zero values below 2^-14", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) { REQUIRE(got.fp16_subnormal == want.fp16_subnormal); });
  const float min_normal = std::ldexp(1.0f, -14);
  const auto s = stats_of({min_normal, -min_normal, std::nextafter(min_normal, 0.0f), 0.0f, 1e-40f, -1e-30f, kNaN});
  REQUIRE(s.fp16_subnormal == 3);
}

TEST_CASE("l2 is the root of the sum of squares of the finite values", "[stats]") {
  sweep([](const TensorStats& got, const TensorStats& want) {
    REQUIRE(std::isfinite(got.l2));
    REQUIRE(got.l2 == Approx(want.l2).epsilon(1e-12).margin(1e-300));
  });
  REQUIRE(stats_of({3.0f, -4.0f, kNaN, kInf}).l2 == 5.0);
}

TEST_CASE("l2 does not overflow for values near the fp32 maximum", "[stats]") {
  const std::vector<float> values(1000, 3.0e38f);
  const auto s = stats_of(values);
  REQUIRE(std::isfinite(s.l2));
  REQUIRE(s.l2 == Approx(double(3.0e38f) * std::sqrt(1000.0)).epsilon(1e-12));
}

TEST_CASE("l2 keeps tiny values whose fp32 squares would underflow", "[stats]") {
  const std::vector<float> values(1'000'000, 1e-20f);
  REQUIRE(stats_of(values).l2 == Approx(double(1e-20f) * 1000.0).epsilon(1e-12));
}

TEST_CASE("results do not depend on the number of threads", "[stats]") {
  const HostTensor t = make_tensor(DType::kFloat32, 1'000'003, Mix::kSpecials, 42);
  const TensorRef ref{t.data(), t.numel, t.dtype};
  TensorStats one, two;
  auto single = make_engine(CpuIsa::kAuto, 1);
  auto dual = make_engine(CpuIsa::kAuto, 2);
  single.compute(&ref, 1, &one);
  dual.compute(&ref, 1, &two);
  REQUIRE(std::memcmp(&one, &two, sizeof one) == 0);
}

TEST_CASE("many tensors in one call each get their own statistics", "[stats]") {
  std::vector<HostTensor> tensors;
  std::vector<TensorRef> refs;
  for (int k = 0; k < 300; ++k) {
    tensors.push_back(make_tensor(kAllDTypes[k % 3], (k * 977) % 5000, Mix::kSpecials, 1000 + std::uint64_t(k)));
  }
  for (const auto& t : tensors) refs.push_back({t.data(), t.numel, t.dtype});
  std::vector<TensorStats> out(refs.size());
  auto engine = make_engine(CpuIsa::kAuto);
  const bool any_nonfinite = engine.compute(refs.data(), refs.size(), out.data());
  bool want_nonfinite = false;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    INFO("tensor " << k);
    const auto want = reference_stats(tensors[k].data(), tensors[k].numel, tensors[k].dtype);
    REQUIRE(out[k].nan == want.nan);
    REQUIRE(out[k].absmax == want.absmax);
    REQUIRE(out[k].l2 == Approx(want.l2).epsilon(1e-12));
    want_nonfinite = want_nonfinite || want.nan || want.inf;
  }
  REQUIRE(any_nonfinite == want_nonfinite);
}

TEST_CASE("every fp16 and bf16 bit pattern is classified as the reference does", "[stats]") {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    HostTensor t;
    t.dtype = dtype;
    t.numel = 65536;
    t.bytes.resize(2 * 65536);
    for (std::uint32_t h = 0; h < 65536; ++h) std::memcpy(t.bytes.data() + 2 * h, &h, 2);
    for (auto isa : supported_isas()) {
      INFO(kernels::cpu_isa_name(isa) << " " << kernels::dtype_name(dtype));
      auto engine = make_engine(isa);
      const TensorRef ref{t.data(), t.numel, t.dtype};
      TensorStats got;
      engine.compute(&ref, 1, &got);
      const auto want = reference_stats(t.data(), t.numel, t.dtype);
      REQUIRE(got.nan == want.nan);
      REQUIRE(got.inf == want.inf);
      REQUIRE(got.zeros == want.zeros);
      REQUIRE(got.fp16_subnormal == want.fp16_subnormal);
      REQUIRE(got.absmax == want.absmax);
      REQUIRE(got.amin_nz == want.amin_nz);
      REQUIRE(got.l2 == Approx(want.l2).epsilon(1e-12));
    }
  }
}

TEST_CASE("the exponent histogram matches the reference", "[stats][histogram]") {
  for (auto isa : supported_isas()) {
    auto engine = make_engine(isa);
    for_each_case([&](const EngineCase& c, const HostTensor& t, void* data) {
      if (c.isa != isa || c.numel > 5000) return;
      INFO(c.describe());
      const TensorRef ref{data, t.numel, t.dtype};
      TensorStats s;
      std::vector<std::uint64_t> hist(kernels::kHistBins, 12345);
      engine.compute(&ref, 1, &s, hist.data());
      const auto want = reference_histogram(t.data(), t.numel, t.dtype);
      REQUIRE(std::equal(hist.begin(), hist.end(), want.begin()));
    });
  }
}

TEST_CASE("histogram bins are powers of two with under- and overflow bins", "[histogram]") {
  const std::vector<float> values = {1.0f,  1.5f,  -2.0f, std::ldexp(1.0f, -40), std::ldexp(1.0f, -41),
                                     std::ldexp(1.0f, 20), std::ldexp(1.0f, 21), 0.0f, kNaN, kInf};
  auto engine = make_engine(CpuIsa::kAuto, 1);
  const TensorRef ref{values.data(), std::int64_t(values.size()), DType::kFloat32};
  TensorStats s;
  std::vector<std::uint64_t> hist(kernels::kHistBins);
  engine.compute(&ref, 1, &s, hist.data());
  auto bin_of_exp = [](int e) { return std::size_t(1 + e - kernels::kHistMinExp); };
  CHECK(hist[bin_of_exp(0)] == 2);    // 1.0 and 1.5
  CHECK(hist[bin_of_exp(1)] == 1);    // -2.0
  CHECK(hist[bin_of_exp(-40)] == 1);  // 2^-40: lowest regular bin
  CHECK(hist[0] == 1);                // 2^-41: underflow
  CHECK(hist[bin_of_exp(20)] == 1);   // 2^20: highest regular bin
  CHECK(hist[kernels::kHistBins - 1] == 1);  // 2^21: overflow
  std::uint64_t total = 0;
  for (auto h : hist) total += h;
  CHECK(total == 7);  // zero, NaN and Inf are not counted
}

TEST_CASE("has_nonfinite says what the statistics' NaN and Inf counts say, on every case of the sweep",
          "[stats][nonfinite]") {
  for_each_case([](const EngineCase& c, const HostTensor& t, void* data) {
    INFO(c.describe());
    const auto engine = make_engine(c.isa, 1);
    const auto want = reference_stats(t.data(), t.numel, t.dtype);
    REQUIRE(engine.has_nonfinite({data, t.numel, t.dtype}) == (want.nan + want.inf > 0));
  });
}

TEST_CASE("has_nonfinite finds a single NaN or Inf anywhere, and never the largest finite value", "[stats][nonfinite]") {
  // The largest finite magnitude of each format, and its NaN/Inf patterns (either sign).
  struct Format {
    DType dtype;
    std::uint32_t largest_finite;
    std::vector<std::uint32_t> nonfinite;
  };
  const Format formats[] = {
      {DType::kFloat32, 0x7f7fffffu, {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffffffffu, 0x7f800001u}},
      {DType::kFloat16, 0x7bffu, {0x7c00u, 0xfc00u, 0x7e00u, 0xffffu, 0x7c01u}},
      {DType::kBFloat16, 0x7f7fu, {0x7f80u, 0xff80u, 0x7fc0u, 0xffffu, 0x7f81u}},
  };
  constexpr std::int64_t n = 5003;  // a vector tail on every ISA
  for (const auto& f : formats)
    for (auto isa : supported_isas()) {
      INFO(kernels::cpu_isa_name(isa) << " " << kernels::dtype_name(f.dtype));
      const auto engine = make_engine(isa, 1);
      const std::size_t size = kernels::element_size(f.dtype);
      std::vector<unsigned char> bytes(std::size_t(n) * size);
      const auto put = [&](std::int64_t i, std::uint32_t bits) { std::memcpy(&bytes[std::size_t(i) * size], &bits, size); };
      for (std::int64_t i = 0; i < n; ++i) put(i, i % 2 ? f.largest_finite : f.largest_finite | (size == 4 ? 0x80000000u : 0x8000u));
      const TensorRef ref{bytes.data(), n, f.dtype};
      CHECK_FALSE(engine.has_nonfinite(ref));
      for (const std::uint32_t bits : f.nonfinite)
        for (const std::int64_t at : {std::int64_t(0), n / 2, n - 1}) {
          put(at, bits);
          CHECK(engine.has_nonfinite(ref));
          put(at, f.largest_finite);
        }
    }
}

TEST_CASE("has_nonfinite on the host's team finds a NaN or Inf in every chunk, the last partial one included",
          "[stats][nonfinite]") {
  // A large tensor goes to the host's parallel_for in chunks; jobs run here in reverse
  // order, so a chunk read at the wrong offset shows.
  std::int64_t jobs_run = 0;
  kernels::CpuEngineOptions options;
  options.chunk_elements = 1024;
  options.parallel_for = [&](std::int64_t count, const std::function<void(std::int64_t)>& task) {
    for (std::int64_t j = count - 1; j >= 0; --j) task(j);
    jobs_run += count;
  };
  constexpr std::int64_t n = 131072 + 1003;  // >= 256 KiB in every format, and a partial last chunk
  const struct {
    DType dtype;
    std::uint32_t one, inf;
  } formats[] = {{DType::kFloat32, 0x3f800000u, 0x7f800000u}, {DType::kFloat16, 0x3c00u, 0x7c00u},
                 {DType::kBFloat16, 0x3f80u, 0x7f80u}};
  for (auto isa : supported_isas())
    for (const auto& f : formats) {
      INFO(kernels::cpu_isa_name(isa) << " " << kernels::dtype_name(f.dtype));
      options.isa = isa;
      const kernels::CpuStatsEngine engine(options);
      const std::size_t size = kernels::element_size(f.dtype);
      std::vector<unsigned char> bytes(std::size_t(n) * size);
      const auto put = [&](std::int64_t i, std::uint32_t v) { std::memcpy(&bytes[std::size_t(i) * size], &v, size); };
      for (std::int64_t i = 0; i < n; ++i) put(i, f.one);
      const TensorRef ref{bytes.data(), n, f.dtype};
      jobs_run = 0;
      CHECK_FALSE(engine.has_nonfinite(ref));
      CHECK(jobs_run == (n + 1023) / 1024);
      for (std::int64_t at = 0; at < n; at += 1024)
        for (const std::int64_t i : {at, std::min(at + 1023, n - 1)}) {
          put(i, f.inf);
          CHECK(engine.has_nonfinite(ref));
          put(i, f.one);
        }
    }
}

TEST_CASE("a pass over fewer than 64 Ki values runs on the calling thread, a larger one on the host's team",
          "[stats][threads]") {
  // Waking the team costs more than a small pass (a small model's gradients) takes.
  std::int64_t team_calls = 0;
  kernels::CpuEngineOptions options;
  options.chunk_elements = 4096;
  options.parallel_for = [&](std::int64_t count, const std::function<void(std::int64_t)>& task) {
    ++team_calls;
    for (std::int64_t j = 0; j < count; ++j) task(j);
  };
  kernels::CpuStatsEngine engine(options);
  const HostTensor a = make_tensor(DType::kFloat32, 30'000, Mix::kSpecials, 7);
  const HostTensor b = make_tensor(DType::kFloat16, 35'535, Mix::kSpecials, 8);  // 65'535 values in all
  const HostTensor c = make_tensor(DType::kFloat32, 1, Mix::kSpecials, 9);
  std::vector<TensorRef> refs{{a.data(), a.numel, a.dtype}, {b.data(), b.numel, b.dtype}};
  std::vector<TensorStats> out(3);
  engine.compute(refs.data(), refs.size(), out.data());
  CHECK(team_calls == 0);
  CHECK(out[1].nan == reference_stats(b.data(), b.numel, b.dtype).nan);
  refs.push_back({c.data(), c.numel, c.dtype});  // 65'536 values
  engine.compute(refs.data(), refs.size(), out.data());
  CHECK(team_calls == 1);
  for (std::size_t k = 0; k < refs.size(); ++k) {
    const HostTensor& t = k == 0 ? a : k == 1 ? b : c;
    INFO("tensor " << k);
    CHECK(out[k].absmax == reference_stats(t.data(), t.numel, t.dtype).absmax);
  }
}

TEST_CASE("has_nonfinite refuses a malformed tensor and says an empty one holds none", "[stats][nonfinite]") {
  const auto engine = make_engine(CpuIsa::kAuto, 1);
  CHECK_FALSE(engine.has_nonfinite({nullptr, 0, DType::kFloat16}));
  CHECK_THROWS_WITH(engine.has_nonfinite({nullptr, 4, DType::kFloat32}), Catch::Contains("data is null"));
}
