// The layer scales of a block: a learnt factor on its residual branch that starts small, so
// that the branch's gradients are that much smaller until it grows (the underflow rule's
// reason, and why exact zeros behind it are flushed values, not a population of their own).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ampdiag/rundb/module_paths.h"
#include "rules.h"

namespace ampdiag::analyzer::rules {

// The layer scales (a learnt per-channel factor on a residual branch: CaiT's gamma_1, timm's
// ls1.gamma, ConvNeXt's layer_scale_parameter, FastViT's layer_scale.gamma) of the block
// holding `layer` whose values started below 1e-3 per element: the branch's gradients are
// about that much smaller until they grow. "blocks.1.gamma_1 or blocks.1.gamma_2, layer
// scales that started at about 1e-05 per element"; empty where there is none.
std::string small_layer_scales(const Run& run, const LayerSummary& layer) {
  std::vector<std::string> names;
  double largest = 0.0;
  bool gains = false;
  for (const auto& [id, w] : first_weight_norms(run)) {
    if (id < 0 || std::size_t(id) >= run.layers.size()) continue;
    const rundb::LayerRow& p = run.layers[std::size_t(id)].info;
    const std::string last = p.name.substr(p.name.rfind('.') + 1);
    // timm's LayerScale2d holds its gamma as [C, 1, 1], to broadcast over a feature map; its
    // LayerScaleBlock (CaiT's) is a block, not a layer scale.
    const bool layer_scale = p.module_type == "LayerScale" || p.module_type == "LayerScale2d";
    const std::vector<std::int64_t> dims = dims_of(p.shape);
    const bool per_channel =
        !dims.empty() && std::all_of(dims.begin() + 1, dims.end(), [](std::int64_t d) { return d == 1; });
    // One gain on the whole branch that starts at 0 (SkipInit's, which timm's DeepMind NFNets
    // hold as skipinit_gain; ReZero's resweight): its branch's gradients start at exactly zero
    // and stay that much smaller while it grows.
    const bool branch_gain = dims.empty() && p.numel == 1 &&
                             (last.find("skipinit") != std::string::npos || last.find("resweight") != std::string::npos);
    if (!branch_gain && (!per_channel || p.numel < 2 ||
                         !(layer_scale || last.find("gamma") != std::string::npos ||
                           last.find("scale") != std::string::npos)))
      continue;
    const double rms = w->l2 / std::sqrt(double(p.numel));
    // Its block: the module holding it, or a LayerScale module's parent.
    const std::string block = layer_scale ? p.module_path.substr(0, p.module_path.rfind('.') == std::string::npos
                                                                        ? 0 : p.module_path.rfind('.'))
                                          : p.module_path;
    if (!(rms > 0.0 || branch_gain) || rms >= 1e-3 || block.empty() || !rundb::within(layer.info.module_path, block) ||
        layer.info.module_path == p.module_path)
      continue;
    names.push_back(p.name);
    largest = std::max(largest, rms);
    gains = gains || branch_gain;
  }
  if (names.empty()) return "";
  std::string joined;
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) joined += (i ? " or " : "") + names[i];
  const std::string what = gains ? (names.size() == 1 ? ", a gain on its branch that" : ", gains on its branches that")
                                 : (names.size() == 1 ? ", a layer scale that" : ", layer scales that");
  return joined + what + (largest > 0.0 ? " started at about " + fmt(largest) + " per element" : " started at 0");
}

}  // namespace ampdiag::analyzer::rules
