// The fused unscale against torch's own op, element by element, and the statistics
// against torch's reductions: links LibTorch (CPU).
#include "../catch_with_torch.h"

#include <ATen/ATen.h>

#include <cstring>

#include "ampdiag/kernels/cpu_stats.h"
#include "reference_stats.h"

using namespace ampdiag;
using namespace ampdiag::test;
using kernels::CpuIsa;
using kernels::MutableTensorRef;

namespace {

at::ScalarType torch_dtype(DType d) {
  switch (d) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
  }
  return at::kFloat;
}

at::Tensor to_torch(const HostTensor& t) {
  return at::from_blob(const_cast<void*>(t.data()), {t.numel}, torch_dtype(t.dtype)).clone();
}

std::uint32_t bits_at(const at::Tensor& t, std::int64_t i) {
  if (t.element_size() == 4) {
    std::uint32_t u;
    std::memcpy(&u, static_cast<const char*>(t.const_data_ptr()) + 4 * i, 4);
    return u;
  }
  std::uint16_t h;
  std::memcpy(&h, static_cast<const char*>(t.const_data_ptr()) + 2 * i, 2);
  return h;
}

// Sizes around torch's vector widths (its tail loop is scalar) and ours.
const std::int64_t kSizes[] = {1, 7, 16, 31, 32, 33, 64, 1000, 4099, 70001};

}  // namespace

TEST_CASE("fused unscale writes exactly what torch's unscale op writes", "[torch][unscale]") {
  // One documented exception: torch's vectorized CPU path writes bf16 NaN as 0xffff and its
  // scalar tail as 0x7fc0, so for bf16 NaN results only "is NaN" is compared.
  kernels::CpuStatsEngine engine;
  std::uint64_t seed = 11;
  for (DType dtype : kAllDTypes) {
    for (Mix mix : {Mix::kSpecials, Mix::kRandomBits}) {
      for (float inv : {1.0f / 65536.0f, 1.0f / 3.0f, 1.0f, 1024.0f}) {
        std::vector<HostTensor> mine;
        std::vector<at::Tensor> theirs;
        for (std::int64_t n : kSizes) {
          mine.push_back(make_tensor(dtype, n, mix, seed++));
          theirs.push_back(to_torch(mine.back()));
        }
        std::vector<MutableTensorRef> refs;
        for (auto& t : mine) refs.push_back({t.data(), t.numel, t.dtype});
        std::vector<TensorStats> stats(refs.size());
        const bool found_inf = engine.unscale_and_compute(refs.data(), refs.size(), inv, stats.data());

        at::Tensor torch_found_inf = at::zeros({1}, at::kFloat);
        at::Tensor torch_inv = at::full({1}, inv, at::kFloat);
        at::_amp_foreach_non_finite_check_and_unscale_(theirs, torch_found_inf, torch_inv);
        REQUIRE(found_inf == (torch_found_inf.item<float>() == 1.0f));
        for (std::size_t k = 0; k < mine.size(); ++k) {
          for (std::int64_t i = 0; i < mine[k].numel; ++i) {
            const std::uint32_t got = mine[k].bits_at(i);
            const std::uint32_t want = bits_at(theirs[k], i);
            if (got == want) continue;  // fast path: REQUIRE per element is slow
            INFO(kernels::dtype_name(dtype) << " mix " << int(mix) << " inv " << inv << " tensor " << k
                                            << " element " << i << std::hex << " got " << got << " want " << want);
            const bool bf16_nan = dtype == DType::kBFloat16 && bits_are_nan(want, dtype) && bits_are_nan(got, dtype);
            REQUIRE(bf16_nan);
          }
        }
      }
    }
  }
}

TEST_CASE("statistics agree with torch's own reductions", "[torch][stats]") {
  kernels::CpuStatsEngine engine;
  std::uint64_t seed = 77;
  for (DType dtype : kAllDTypes) {
    const HostTensor t = make_tensor(dtype, 100003, Mix::kSpecials, seed++);
    const kernels::TensorRef ref{t.data(), t.numel, t.dtype};
    TensorStats s;
    engine.compute(&ref, 1, &s);
    const at::Tensor g = to_torch(t).to(at::kFloat);
    const at::Tensor finite_abs = at::where(at::isfinite(g), g.abs(), at::zeros_like(g));
    INFO(kernels::dtype_name(dtype));
    CHECK(s.nan == at::isnan(g).sum().item<std::int64_t>());
    CHECK(s.inf == at::isinf(g).sum().item<std::int64_t>());
    CHECK(s.zeros == (g == 0).sum().item<std::int64_t>());
    CHECK(s.absmax == finite_abs.max().item<float>());
    CHECK(s.l2 == Approx(finite_abs.to(at::kDouble).norm().item<double>()).epsilon(1e-12));
  }
}
