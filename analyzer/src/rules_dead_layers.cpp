// dead-layers: most of the values the run trains got exactly zero gradients in every
// recorded step from some step to the end (at least 5), while another layer's last did not:
// nothing passes back through them (a ReLU whose every input is below 0, after a bias or an
// update that pushed it there), so they do not train while the report's other rules see
// nothing wrong. A module whose output was all zeros is named. A small share is a module the
// task leaves unused behind `0 * p` (DDP's workaround for unused parameters), not a finding;
// every gradient zero is zero-gradients'.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rules.h"

namespace ampdiag::analyzer::rules {

namespace {

bool trains_own(const Run& run, const std::string& module) {
  for (const auto& layer : run.layers)
    if (layer.info.trainable && layer.info.module_path == module) return true;
  return false;
}

// A normalisation with nothing of its own to train whose output was all zeros from `first`
// on, while the module that finished just before it never made all zeros: it maps values
// to zeros, which only a weight of 0 does, and that weight stays 0 (a frozen BatchNorm whose
// copy of a ResNet block's zero-initialised last norm never trains away). The fix names the
// first such norm and how many there were.
std::optional<Suggestion> frozen_zero_norm(const Run& run, std::int64_t first) {
  const ModuleSummary* named = nullptr;
  const ModuleSummary* before_named = nullptr;
  std::int64_t count = 0;
  for (const auto& m : run.modules) {
    if (m.zero_step < first || m.info.module_type.find("Norm") == std::string::npos || m.before_last < 0 ||
        trains_own(run, m.info.path))
      continue;
    const ModuleSummary& before = run.modules[std::size_t(m.before_last)];
    if (before.zero_step >= 0 || !(before.max_absmax > 0.0f)) continue;
    if (count++ == 0) {
      named = &m;
      before_named = &before;
    }
  }
  if (named == nullptr) return std::nullopt;
  return Suggestion{
      named->info.path + " (" + named->info.module_type + ") trains nothing of its own and made all zeros of " +
          before_named->info.path + "'s output, which was not zeros" +
          (count > 1 ? " (" + plural(count - 1, "more normalisation") + " alike)" : std::string()) +
          ": a normalisation whose weight is 0 and frozen (a buffer, or requires_grad=False) outputs only its bias and "
          "sends no gradient back. ResNets in timm and torchvision start each residual block's last norm at weight 0 "
          "(timm's zero_init_last, torchvision's zero_init_residual) for the norm to train away from it; frozen, it "
          "stays 0. Load the backbone's pretrained weights before its norms are frozen, or build it without that zero "
          "initialisation.",
      "", "", ""};
}

}  // namespace

void dead_layers(const Run& run, std::vector<Finding>& out) {
  constexpr std::int64_t kMinSamples = 5;
  std::int64_t values = 0, dead_values = 0, first = -1;
  std::vector<const LayerSummary*> dead;
  const LayerSummary* alive = nullptr;
  std::set<std::string> lively;  // trainable layers with a gradient not all zeros in some step
  for (const auto& layer : run.layers) {
    if (!layer.info.trainable) continue;
    // Its finite samples, and the all-zero ones at their end: from where it died to the end.
    std::int64_t finite = 0, trailing = 0, from = -1;
    for (const auto& s : layer.samples) {
      if (s.nonfinite) continue;
      ++finite;
      if (s.zero_q != 65535) {
        trailing = 0;
      } else if (trailing++ == 0) {
        from = s.step;
      }
    }
    if (finite == 0) continue;
    if (trailing < finite) lively.insert(layer.info.name);
    values += layer.info.numel;
    if (trailing >= kMinSamples && !embedding_like(layer.info)) {
      dead.push_back(&layer);
      dead_values += layer.info.numel;
      if (first < 0 || from < first) first = from;
    } else if (trailing == 0 && !alive) {
      alive = &layer;  // its last gradient was not all zeros
    }
  }
  if (!alive || dead.empty() || 2 * dead_values <= values) return;
  Finding f;
  f.rule = "dead-layers";
  f.severity = Severity::kWarning;
  f.score = 46.0;
  f.layer = dead.front()->info.name;
  f.module = dead.front()->info.module_path;
  f.steps = {first};
  const bool from_start = first <= run.steps.front().row.step;
  f.title = std::to_string(dead.size()) + " layers' gradients were exactly zero in every step" +
            (from_start ? std::string() : " from step " + std::to_string(first)) + " (" +
            pct(double(dead_values) / double(values)) + " of the trained values): nothing passes back through them, so they do not train";
  std::string named;
  for (std::size_t i = 0; i < dead.size() && i < 6; ++i) named += (i ? ", " : "") + dead[i]->info.name;
  if (dead.size() > 6) named += " and " + plural(std::int64_t(dead.size() - 6), "more layer");
  f.evidence = "every recorded gradient of " + named + " was all zeros, from step " + std::to_string(first) +
               ", while " + alive->info.name + "'s was not";
  // A module whose weight's gradient was zero while its bias's was not took all-zero inputs:
  // what fed it zeroed every value (the dead ReLU before a classifier's last Linear).
  for (const LayerSummary* weight : dead) {
    const std::string& name = weight->info.name;
    if (!ends_with(name, ".weight") || !lively.count(name.substr(0, name.size() - 7) + ".bias")) continue;
    f.evidence += "; " + weight->info.module_path + "'s weight got none while its bias did, so its input was all "
                  "zeros: what feeds it zeroed every value";
    break;
  }
  // The modules whose output was all zeros: where the gradient stops.
  std::string zeros;
  int listed = 0;
  for (const auto& m : run.modules)
    if (m.zero_step >= first && listed < 3) {
      zeros += (listed++ ? ", " : "") + m.info.path + (m.info.module_type.empty() ? "" : " (" + m.info.module_type + ")");
    }
  if (!zeros.empty())
    f.evidence += "; the output of " + zeros + " was all zeros, which sends back no gradient";
  std::string look =
      "Look for what zeroes everything after them: a ReLU whose every input is below 0 (a bias or an update that "
      "pushed its inputs there: lower the learning rate, initialise the bias at 0, or use LeakyReLU or GELU), a gate or "
      "mask stuck at 0. Where they are meant to be unused, freeze them and leave them out of the optimizer.";
  const std::vector<FlushedLayer> flushed = flushed_layers(run);
  const bool flushed_dead = std::any_of(flushed.begin(), flushed.end(), [&](const FlushedLayer& w) {
    return w.in_range < 0 && std::find(dead.begin(), dead.end(), w.layer) != dead.end();
  });
  if (flushed_dead) {
    f.suggestions.push_back({"Initialise the weights that float16 holds none of at a standard scale (see "
                             "flushed-weights): cast to float16 they are zeros, which make zeros and send no gradient "
                             "back, so neither they nor the layers before them train.",
                             "", "", ""});
    look = "Otherwise, l" + look.substr(1);
  } else if (auto norm = frozen_zero_norm(run, first)) {
    f.suggestions.push_back(*norm);
    look = "Otherwise, l" + look.substr(1);
  }
  f.suggestions.push_back({look, "", "", ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
