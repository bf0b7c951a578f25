// Smoke demo of the kernels: a handful of "gradients" as a scaled fp16 run would hold
// them, one of them overflowed, and the per-tensor statistics the agent records.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "ampdiag/kernels/cpu_stats.h"

using namespace ampdiag::kernels;

int main() {
  struct Layer {
    const char* name;
    std::vector<float> grad;
  };
  const float scale = 65536.0f;  // the loss scale these gradients are still multiplied by
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto gradient = [&](std::size_t n, float magnitude) {
    std::vector<float> g(n);
    for (auto& x : g) x = normal(rng) * magnitude * scale;
    return g;
  };
  std::vector<Layer> layers = {
      {"patch_embed.weight", gradient(768 * 48, 1e-3f)},
      {"blocks.0.attn.qkv.weight", gradient(2304 * 768, 2e-1f)},
      {"blocks.0.mlp.fc1.weight", gradient(3072 * 768, 1e-4f)},
      {"head.weight", gradient(1000 * 768, 1e-9f)},
  };
  layers[1].grad[12345] = std::numeric_limits<float>::infinity();  // the overflow
  layers[1].grad[999] = std::numeric_limits<float>::quiet_NaN();

  std::vector<TensorRef> refs;
  for (const auto& l : layers) refs.push_back({l.grad.data(), std::int64_t(l.grad.size()), DType::kFloat32});
  std::vector<TensorStats> stats(refs.size());
  CpuStatsEngine engine;
  const bool found_inf = engine.compute(refs.data(), refs.size(), stats.data());

  std::printf("ampdiag kernels smoke demo (%s, %d threads), loss scale %.0f\n\n", cpu_isa_name(engine.isa()),
              engine.threads(), scale);
  std::printf("%-26s %10s %5s %5s %12s %12s %10s %9s\n", "layer", "numel", "nan", "inf", "absmax", "l2",
              "headroom", "f16-sub%");
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const TensorStats& s = stats[i];
    const double headroom = s.absmax > 0 ? std::log2(65504.0 / s.absmax) : INFINITY;
    std::printf("%-26s %10lld %5lld %5lld %12.4g %12.4g %9.1fb %8.1f%%\n", layers[i].name, (long long)s.numel,
                (long long)s.nan, (long long)s.inf, s.absmax, s.l2, headroom,
                100.0 * double(s.fp16_subnormal) / double(s.numel));
  }
  std::printf("\nfound_inf = %s: the scaler would skip this step and back off the scale.\n",
              found_inf ? "true" : "false");
  return found_inf ? 0 : 1;
}
