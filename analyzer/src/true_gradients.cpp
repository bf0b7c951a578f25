// true_gradients.h: the unscaled gradients overflow-origin weighs.
#include "true_gradients.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "ampdiag/rundb/module_paths.h"
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

// Whether `block` holds at most a quarter of the trained values: a block that holds most of
// the model (an LM's decoder stack, a feature extractor) pinned is the model trained in FP32.
bool small_block(const Run& run, const std::string& block) {
  std::int64_t trained = 0, held = 0;
  for (const LayerSummary& layer : run.layers) {
    if (!layer.info.trainable) continue;
    trained += layer.info.numel;
    if (suggest::within(layer.info.module_path, block)) held += layer.info.numel;
  }
  return 4 * held <= trained;
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

FlatNorm flat_normalisation_after(const Run& run, const std::string& module) {
  if (module.empty()) return {};
  for (const ModuleSummary& norm : run.modules) {
    // Only what divides by its input's own spread: MobileBERT's NoNorm is an affine map, and a
    // FrozenBatchNorm divides by statistics it keeps.
    const std::string& type = norm.info.module_type;
    if (type.find("Norm") == std::string::npos || type.find("NoNorm") != std::string::npos ||
        type.find("Frozen") != std::string::npos || norm.before_last < 0)
      continue;
    const std::string& before = run.modules[std::size_t(norm.before_last)].info.path;
    if (before != module && !suggest::within(module, before) && !suggest::within(before, module)) continue;
    // A weight of 0 would make zeros too, and send no gradient back: only a known one counts.
    double weight = 0.0;
    for (const LayerSummary& layer : run.layers)
      if (layer.info.name == norm.info.path + ".weight") weight = mean_weight_rms(run, layer);
    if (!(weight > 0.0)) continue;
    const double output = norm.output_rms_rows > 0 ? norm.output_rms_sum / double(norm.output_rms_rows) : -1.0;
    if (norm.zero_step >= 0) return {&norm, "its output was all zeros at step " + std::to_string(norm.zero_step)};
    if (output >= 0.0 && output < weight / 8.0)
      return {&norm, "its outputs' RMS was " + fmt(output) + ", 1/" + fmt(std::round(weight / output)) +
                         " of its weight's"};
  }
  return {};
}

std::string flat_norm_evidence(const FlatNorm& flat, const std::string& module) {
  if (flat.norm == nullptr) return {};
  const bool inside = suggest::within(flat.norm->info.path, module);
  return "; " + flat.norm->info.path + " (" + flat.norm->info.module_type + "), " +
         (inside ? std::string("inside it") : "which takes " + module + "'s output") + ", normalised an input with next "
         "to no spread (" + flat.made + "): a normalisation's backward multiplies the gradient by its weight over that "
         "spread, sqrt(variance + eps), which is sqrt(eps) where the variance is 0 (316 times for eps 1e-5, 1e6 for "
         "1e-12), so " + (inside ? "the layers of " + module + " before it receive" : module + " receives") +
         " a gradient that many times the one reaching the norm: an input constant over what the norm normalises (a "
         "residual stream that starts at zeros, as a DETR decoder's first self-attention over queries of zeros)";
}

std::optional<Suggestion> spread_zero_inputs(const Run& run, const ModuleSummary& norm) {
  std::vector<const LayerSummary*> zero;
  for (const auto& [id, w] : first_weight_norms(run)) {
    const LayerSummary& layer = run.layers[std::size_t(id)];
    const std::string& name = layer.info.name;
    if (layer.info.trainable && w->l2 == 0.0 && dims_of(layer.info.shape).size() >= 2 && !weight_named(name) &&
        !ends_with(name, "bias"))
      zero.push_back(&layer);
  }
  if (zero.empty()) return std::nullopt;
  const std::string& name = zero.front()->info.name;
  std::string others;
  for (std::size_t i = 1; i < zero.size() && i < 4; ++i) others += ", " + zero[i]->info.name;
  Suggestion s;
  s.summary = "Initialise " + name + others + " away from zero (torch.nn.init.normal_ with std 0.02, as BLIP-2's "
              "original code starts its query tokens): " + (zero.size() == 1 ? "it" : "they") + " started at exactly "
              "zero, a learned input that " + norm.info.path + " and the normalisations before it then normalise with "
              "no spread, and a normalisation's backward multiplies the gradient by 1/sqrt(eps) there: 316 for eps "
              "1e-5, 1e6 for the 1e-12 of BERT-style layers, beyond fp16 at any scale and a step far too large in FP32 "
              "too. Hugging Face initialises BLIP-2's and InstructBLIP's query_tokens to zeros, for loading pretrained "
              "weights.";
  s.python = "torch.nn.init.normal_(model.get_parameter(\"" + name + "\"), std=0.02)  # was all zeros";
  s.untried = true;
  return s;
}

std::string holding_all(const Run& run, const std::string& module,
                        const std::vector<std::pair<std::string, double>>& others) {
  std::vector<std::string> paths;
  for (const auto& [name, value] : others)
    for (const LayerSummary& layer : run.layers)
      if (layer.info.name == name) paths.push_back(layer.info.module_path);
  if (paths.size() != others.size()) return {};
  for (std::string holder = module; !holder.empty(); holder = rundb::parent_of(holder))
    if (run.module_named(holder) != nullptr &&
        std::all_of(paths.begin(), paths.end(), [&](const std::string& p) { return suggest::within(p, holder); }))
      return small_block(run, holder) ? holder : std::string();
  return {};
}

std::string block_before(const Run& run, const std::string& module, const ModuleSummary& norm) {
  std::string block = module;
  for (std::string up = rundb::parent_of(block); !up.empty() && run.module_named(up) != nullptr &&
                                          !suggest::within(norm.info.path, up) && small_block(run, up);
       up = rundb::parent_of(up))
    block = up;
  return block;
}

// DETR's first decoder self-attention: its output and value projections' biases, one block's.
void pin_beyond_others(const Run& run, const std::string& module, const std::string& layer,
                       const std::vector<std::pair<std::string, double>>& others, bool at_any_scale,
                       double scale_floor, Finding& f) {
  const std::string beyond = at_any_scale ? std::string("65504") : "65504 / " + fmt(scale_floor);
  std::string named;
  for (std::size_t k = 0; k < others.size() && k < 3; ++k)
    named += (k ? ", " : "") + others[k].first + " up to " + fmt(others[k].second);
  if (others.size() > 3) named += ", and " + plural(std::int64_t(others.size() - 3), "more layer");
  f.evidence += "; other layers' unscaled gradients were beyond " + beyond + " too (" + named + "), so pinning " +
                (module.empty() ? layer : module) + " alone would leave " +
                (at_any_scale ? "theirs overflowing" : "the scale below the floor");
  if (const std::string holder = holding_all(run, module, others); !holder.empty()) {
    f.suggestions.push_back(suggest::pin_fp32(run, holder));
    f.suggestions.back().summary =
        "Run " + holder + " in FP32, which holds " + module + " and every other layer whose gradients passed " + beyond +
        ": autocast off around it, its floating-point inputs cast to float32, so that their backwards make and sum "
        "them in float32.";
  }
}

}  // namespace ampdiag::analyzer::rules
