// true_gradients.h: the unscaled gradients overflow-origin weighs.
#include "true_gradients.h"

#include <algorithm>
#include <set>
#include <string>

#include "suggestions.h"

namespace ampdiag::analyzer::rules {

std::pair<double, std::int64_t> largest_true_gradient(const LayerSummary& layer, const std::map<std::int64_t, double>& scale_of) {
  double largest = 0.0;
  std::int64_t at = -1;
  for (const auto& g : layer.samples) {
    const auto it = scale_of.find(g.step);
    if (g.nonfinite || it == scale_of.end() || it->second <= 0.0) continue;
    if (const double v = double(g.absmax) / it->second; v > largest) {
      largest = v;
      at = g.step;
    }
  }
  return {largest, at};
}

bool float32_embedding(const rundb::LayerRow& layer) {
  return layer.module_type.find("Embedding") != std::string::npos && layer.dtype == "float32";
}

namespace {

// Whether `layer`'s gradient is computed in FP32, so that it can pass 65504 without an fp16
// backward: autocast runs normalisation layers and float32 embeddings so, and the run so
// computed those `fp32` holds (pinned modules', event fp32-gradients).
bool gradient_made_in_fp32(const LayerSummary& layer, const Fp32Gradients& fp32) {
  return layer.info.module_type.find("Norm") != std::string::npos || float32_embedding(layer.info) ||
         fp32.holds(layer.info);
}

}  // namespace

TrueGradient largest_true_gradient_of(const Run& run, const std::string& module,
                                      const std::map<std::int64_t, std::int64_t>& first_in,
                                      const std::map<std::int64_t, double>& scale_of, const Fp32Gradients& fp32) {
  TrueGradient largest;
  for (const LayerSummary& layer : run.layers) {
    const bool first = first_in.count(layer.info.id) > 0;
    if (!first && (module.empty() || !suggest::within(layer.info.module_path, module) ||
                   gradient_made_in_fp32(layer, fp32)))
      continue;
    if (const auto [value, step] = largest_true_gradient(layer, scale_of); value > largest.value)
      largest = {value, step, layer.info.id};
  }
  return largest;
}

std::vector<std::pair<std::string, double>> also_beyond(const Run& run, const std::string& module, double limit,
                                                        const std::map<std::int64_t, double>& scale_of,
                                                        const Fp32Gradients& fp32) {
  std::vector<std::pair<std::string, double>> beyond;
  for (const LayerSummary& layer : run.layers) {
    if (suggest::within(layer.info.module_path, module) || gradient_made_in_fp32(layer, fp32)) continue;
    if (const double v = largest_true_gradient(layer, scale_of).first; v > limit) beyond.emplace_back(layer.info.name, v);
  }
  std::stable_sort(beyond.begin(), beyond.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return beyond;
}

std::string products_only_type(const Run& run, const std::string& module) {
  static const std::set<std::string> types = {"Linear", "NonDynamicallyQuantizableLinear", "LazyLinear", "Bilinear",
                                              "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                                              "ConvTranspose3d", "Embedding", "EmbeddingBag"};
  const ModuleSummary* m = module.empty() ? nullptr : run.module_named(module);
  if (m == nullptr || !types.count(m->info.module_type) || m->info.source.find("/torch/nn/") == std::string::npos) return {};
  return m->info.module_type;
}

}  // namespace ampdiag::analyzer::rules
