// The gradient set of a ViT-B/16 (12 blocks of 12 parameter tensors, 85 M fp32 values),
// filled with gradient-like values as a scaled fp16 run holds them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ampdiag::bench {

struct GradientTensor {
  std::string name;
  std::vector<float> values;
};

std::vector<GradientTensor> make_vit_b_gradients(float loss_scale, std::uint64_t seed);
std::int64_t total_elements(const std::vector<GradientTensor>& tensors);

}  // namespace ampdiag::bench
