// unreached-layers: most of the model's trainable values never received a gradient: the
// backward from the loss never reached them (a reentrant checkpoint over inputs that need
// no gradient, a detach(), parameters frozen after attach()). They do not train, and no
// statistic of theirs backs the report's other verdicts. A small unreached share is a
// module the task does not use (a Hugging Face pooler, Longformer's global attention
// projections: a fifth), not a finding.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "rules.h"

namespace ampdiag::analyzer::rules {

void unreached_layers(const Run& run, std::vector<Finding>& out) {
  constexpr std::size_t kMinSteps = 5;
  if (run.steps.size() < kMinSteps) return;
  std::int64_t trainable = 0, unreached = 0, layers = 0;
  std::vector<const LayerSummary*> none;
  const LayerSummary* reached = nullptr;
  for (const auto& layer : run.layers) {
    if (!layer.info.trainable) continue;
    ++layers;
    trainable += layer.info.numel;
    if (!layer.samples.empty()) {
      if (!reached) reached = &layer;
      continue;
    }
    unreached += layer.info.numel;
    none.push_back(&layer);
  }
  // Without any gradient row the agent recorded none at all: the report says so elsewhere.
  if (!reached || 2 * unreached <= trainable) return;
  Finding f;
  f.rule = "unreached-layers";
  f.severity = Severity::kWarning;
  f.score = 45.0;
  f.module = none.front()->info.module_path;
  f.layer = none.front()->info.name;
  f.steps = {run.steps.front().row.step};
  char share[16];
  std::snprintf(share, sizeof share, "%.0f%%", 100.0 * double(unreached) / double(trainable));
  f.title = std::to_string(none.size()) + " of " + plural(layers, "trainable layer") + " never received a gradient (" +
            share + " of the trainable values): the backward from the loss never reached them, so they do not train";
  std::string named;
  for (std::size_t i = 0; i < none.size() && i < 6; ++i) named += (i ? ", " : "") + none[i]->info.name;
  if (none.size() > 6) named += " and " + plural(std::int64_t(none.size() - 6), "more layer");
  f.evidence = "in " + plural(std::int64_t(run.steps.size()), "step") + " no gradient of " + named +
               " arrived, while " + reached->info.name + "'s did; they required a gradient when attached, and no "
               "overflow or underflow of theirs could be judged";
  f.suggestions.push_back(
      {"Find where the path from the loss to them is cut: torch.utils.checkpoint(..., use_reentrant=True) over an input "
       "that needs no gradient (a frozen embedding's output) gives the checkpointed block none, which "
       "use_reentrant=False does; a .detach() or torch.no_grad() in forward(); or parameters frozen after attach(), "
       "which the optimizer need not hold.",
       "h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)  # not use_reentrant=True",
       "", ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
