// stalled-updates and half-parameters: a model whose parameters are themselves fp16 or bf16
// (model.half(), no FP32 master weights). An update smaller than half a unit in the last
// place of a weight rounds away; the agent counts, on measured steps, the elements whose
// gradient was non-zero and whose value stayed the same (weight_updates).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

double stalled_share(const LayerSummary& l) {
  return l.update_nonzero > 0 ? double(l.update_stalled) / double(l.update_nonzero) : 0.0;
}

std::string percent(double share) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f %%", 100.0 * share);
  return b;
}

}  // namespace

bool half_dtype(const std::string& dtype) { return dtype == "float16" || dtype == "bfloat16"; }

void half_parameters(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  std::int64_t half_layers = 0, trainable = 0, half_elements = 0, measured_steps = 0;
  std::int64_t nonzero = 0, stalled = 0;
  std::string dtype;
  std::vector<const LayerSummary*> stalling;
  for (const auto& l : run.layers) {
    if (!l.info.trainable) continue;
    ++trainable;
    if (!half_dtype(l.info.dtype)) continue;
    ++half_layers;
    half_elements += l.info.numel;
    dtype = dtype.empty() || dtype == l.info.dtype ? l.info.dtype : "float16 and bfloat16";
    measured_steps = std::max(measured_steps, l.update_steps);
    nonzero += l.update_nonzero;
    stalled += l.update_stalled;
    if (l.update_nonzero > 0 && stalled_share(l) > t.stalled_fraction) stalling.push_back(&l);
  }
  if (half_layers == 0) return;
  // Rows exist only where the optimizer stepped the half-precision tensors themselves: an
  // optimizer over FP32 master copies leaves none, so without rows nothing is claimed.
  const bool direct = nonzero > 0;
  const std::string kept = "the run keeps " + std::to_string(half_layers) + " of " +
                           plural(trainable, "trainable parameter tensor") + " (" + std::to_string(half_elements) +
                           " elements) in " + dtype + (direct ? ", with no FP32 master weights" : "");
  if (stalling.empty()) {
    Finding f;
    f.rule = "half-parameters";
    f.severity = Severity::kInfo;
    f.score = 0.5;
    f.title = direct ? "The model trains " + std::to_string(half_layers) + " of " +
                           plural(trainable, "parameter tensor") + " in " + dtype +
                           " (no FP32 master weights); their updates did not stall"
                     : "The model holds " + std::to_string(half_layers) + " of " + plural(trainable, "parameter tensor") +
                           " in " + dtype;
    f.evidence = kept + "; " +
                 (direct ? "on " + plural(measured_steps, "measured step") + ", " + percent(double(stalled) / double(nonzero)) +
                                    " of the elements with a non-zero gradient kept their value (a layer is flagged above " +
                                    percent(t.stalled_fraction) + ")"
                         : std::string("no optimizer step updated them directly on a measured step (the optimizer "
                                       "may keep FP32 master copies, no sampled step ran one, or the agent predates "
                                       "the measurement)"));
    out.push_back(std::move(f));
    return;
  }
  // The layer that loses the most updates first.
  std::stable_sort(stalling.begin(), stalling.end(), [](const LayerSummary* a, const LayerSummary* b) {
    return a->update_stalled > b->update_stalled;
  });
  const LayerSummary& worst = *stalling.front();
  Finding f;
  f.rule = "stalled-updates";
  f.severity = Severity::kWarning;
  f.layer = worst.info.name;
  f.module = worst.info.module_path;
  f.score = 10.0 * stalled_share(worst);
  f.steps = {worst.first_update_step};
  f.title = "Most updates of " + plural(std::int64_t(stalling.size()), "layer") + " round away in " + dtype + ": " +
            worst.info.name + " kept " + percent(stalled_share(worst)) +
            " of its values although their gradients were not zero";
  f.evidence = kept + "; an update smaller than half a unit in the last place of a weight rounds away. Over " +
               plural(measured_steps, "measured step") + ", ";
  for (std::size_t i = 0; i < stalling.size() && i < 5; ++i) {
    const LayerSummary& l = *stalling[i];
    f.evidence += std::string(i ? "; " : "") + l.info.name + ": " + percent(stalled_share(l)) + " of " + std::to_string(l.update_nonzero) +
                  " element updates stalled";
  }
  if (stalling.size() > 5) f.evidence += "; and " + plural(std::int64_t(stalling.size() - 5), "more layer");
  f.suggestions.push_back(suggest::fp32_master_weights(run));
  out.push_back(std::move(f));
}

}  // namespace ampdiag::analyzer::rules
