// ViT-B/16 gradient shapes; see vit_gradients.h.
#include "vit_gradients.h"

#include <random>
#include <thread>

namespace ampdiag::bench {

std::vector<GradientTensor> make_vit_b_gradients(float loss_scale, std::uint64_t seed) {
  constexpr std::int64_t d = 768, mlp = 3072;
  const std::pair<const char*, std::int64_t> block[] = {
      {"norm1.weight", d},          {"norm1.bias", d},     {"attn.qkv.weight", 3 * d * d}, {"attn.qkv.bias", 3 * d},
      {"attn.proj.weight", d * d},  {"attn.proj.bias", d}, {"norm2.weight", d},           {"norm2.bias", d},
      {"mlp.fc1.weight", mlp * d},  {"mlp.fc1.bias", mlp}, {"mlp.fc2.weight", d * mlp},   {"mlp.fc2.bias", d},
  };
  std::vector<GradientTensor> tensors;
  for (int b = 0; b < 12; ++b)
    for (const auto& [name, numel] : block)
      tensors.push_back({"blocks." + std::to_string(b) + "." + name, std::vector<float>(std::size_t(numel))});
  // Filling 85 M values is the slow part of start-up: two threads, each its own generator.
  auto fill = [&](std::size_t first, std::size_t step) {
    std::mt19937 rng(std::uint32_t(seed + first));
    std::normal_distribution<float> normal(0.0f, 1e-3f * loss_scale);
    for (std::size_t t = first; t < tensors.size(); t += step)
      for (auto& v : tensors[t].values) v = normal(rng);
  };
  std::thread helper(fill, 1, 2);
  fill(0, 2);
  helper.join();
  return tensors;
}

std::int64_t total_elements(const std::vector<GradientTensor>& tensors) {
  std::int64_t n = 0;
  for (const auto& t : tensors) n += std::int64_t(t.values.size());
  return n;
}

}  // namespace ampdiag::bench
