// unreached-layers: most of the values an optimizer holds never received a gradient (event
// "parameters-unreached", Python agent: those whose gradient had not arrived by its 20th
// read of the optimizers' gradients, or at close()): the backward from the loss never
// reached them (a reentrant checkpoint over inputs that need no gradient, a detach()), so
// they do not train, and no statistic of theirs backs the report's other verdicts. A small
// unreached share is a module the task does not use (a Hugging Face pooler, Longformer's
// global attention projections: a fifth), not a finding; a parameter no optimizer holds
// (linear probing) is none at all.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

// The first six of the event's comma-separated names, "and N more" for the others of `count`.
std::string first_names(const std::string& names, long long count) {
  constexpr long long kShown = 6;
  std::size_t end = 0;
  for (long long i = 0; i < kShown && end != std::string::npos; ++i) end = names.find(", ", end == 0 ? 0 : end + 2);
  if (end == std::string::npos || names.find(" more", end) != std::string::npos) return names;
  return names.substr(0, end) + " and " + std::to_string(count - kShown) + " more";
}

}  // namespace

void unreached_layers(const Run& run, std::vector<Finding>& out) {
  const rundb::EventRow* e = run.first_event("parameters-unreached");
  if (!e) return;
  long long values = 0, total = 0, count = 0, held = 0;
  if (std::sscanf(e->detail.c_str(), "%lld of %lld values, %lld of %lld parameters", &values, &total, &count, &held) !=
          4 ||
      total <= 0 || 2 * values <= total)
    return;
  const std::size_t colon = e->detail.find(": ");
  const std::string names = colon == std::string::npos ? std::string() : e->detail.substr(colon + 2);
  Finding f;
  f.rule = "unreached-layers";
  f.severity = Severity::kWarning;
  f.score = 45.0;
  f.layer = names.substr(0, names.find(", "));
  if (f.layer.find(' ') != std::string::npos) f.layer.clear();  // not one name: "... and 3 more"
  for (const auto& layer : run.layers)
    if (layer.info.name == f.layer) f.module = suggest::module_for_layer(run, layer.info);
  f.steps = {e->step >= 0 ? e->step : run.steps.front().row.step};
  f.title = std::to_string(count) + " of the " + plural(held, "parameter") + " the optimizer holds never received a " +
            "gradient (" + pct(double(values) / double(total)) + " of their values): the backward from the loss never reached them, so they do "
            "not train";
  f.evidence = "by step " + std::to_string(f.steps.front()) + " no gradient of " + first_names(names, count) +
               " had arrived; no overflow or underflow of theirs could be judged";
  f.suggestions.push_back(
      {"Find where the path from the loss to them is cut: torch.utils.checkpoint(..., use_reentrant=True) over an input "
       "that needs no gradient (a frozen embedding's output) gives the checkpointed block none, which "
       "use_reentrant=False does; a .detach() or torch.no_grad() in forward(); or a vector quantizer that hands on its "
       "codebook's entries by their integer codes, which carry no gradient, with no straight-through estimator "
       "(quantized = x + (q - x).detach()) to pass the gradient on to its encoder. Where they are meant to stay as "
       "they are, freeze them (requires_grad_(False)) and leave them out of the optimizer.",
       "h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)  # not use_reentrant=True",
       "", ""});
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
