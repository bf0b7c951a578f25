// flushed-weights: weights so small that float16 holds none of them. Autocast casts a
// Linear's or a convolution's weights to fp16 for the matmul; every value below 2^-24
// (5.96e-08, fp16's smallest positive one) comes out 0 or that one value, so the layer
// computes with zeros and hands on zeros, with no NaN, no skipped step, no gradient out of
// range. Hugging Face's BLIP, BLIP-2, InstructBLIP and SAM vision configs default to
// initializer_range=1e-10, meant for loading pretrained weights: built from the config,
// their vision encoders run on zeros.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "ampdiag/rundb/module_paths.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

namespace {

constexpr double kFp16Smallest = 0x1p-24;

bool held_by_fp16(const rundb::WeightNormRow& w) { return w.absmax >= kFp16Smallest; }

std::map<std::int64_t, std::vector<const rundb::WeightNormRow*>> readings_by_layer(const Run& run) {
  std::map<std::int64_t, std::vector<const rundb::WeightNormRow*>> by_layer;
  for (const auto& w : run.weight_norms) by_layer[w.layer_id].push_back(&w);
  for (auto& [id, rows] : by_layer)
    std::sort(rows.begin(), rows.end(), [](const auto* a, const auto* b) { return a->step < b->step; });
  return by_layer;
}

}  // namespace

std::vector<FlushedLayer> flushed_layers(const Run& run) {
  std::vector<FlushedLayer> found;
  if (!run.fp16()) return found;  // bf16 keeps fp32's range: such weights keep their values
  for (const auto& [id, rows] : readings_by_layer(run)) {
    const LayerSummary& layer = run.layers[std::size_t(id)];
    const ModuleSummary* module = run.module_named(layer.info.module_path);
    // Its module's output all zeros shows the cast: in FP32, weights that are not 0 make an
    // output that is not 0 from an input that is not.
    if (!weight_matrix(layer.info) || module == nullptr || module->zero_step < 0) continue;
    const rundb::WeightNormRow* at = nullptr;
    std::int64_t since = -1;
    for (const auto* w : rows) {
      if (w->step > module->zero_step) break;
      at = w;
      if (held_by_fp16(*w)) since = -1;
      else if (since < 0) since = w->step;
    }
    if (at == nullptr || !(at->absmax > 0.0) || held_by_fp16(*at)) continue;
    FlushedLayer f{&layer, at, module->zero_step, since, -1, 0.0};
    for (const auto* w : rows)
      if (w->step > at->step && held_by_fp16(*w)) {
        f.in_range = w->step;
        f.in_range_absmax = w->absmax;
        break;
      }
    found.push_back(f);
  }
  return found;
}

bool flushed_at(const std::vector<FlushedLayer>& flushed, const std::string& module, std::int64_t step) {
  return std::any_of(flushed.begin(), flushed.end(), [&](const FlushedLayer& f) {
    return rundb::within(f.layer->info.module_path, module) && f.since <= step &&
           (f.in_range < 0 || step < f.in_range);
  });
}

namespace {

// What the finding says of `flushed`: the one it leads with (one that stayed below where any
// did), the step by which the optimizer lifted every one into range (-1: some never were)
// and the least of their largest values then, the first step any was below, and the last
// all-zero output of those that stayed.
struct FlushedSummary {
  const FlushedLayer* lead = nullptr;
  std::int64_t lifted = -1;
  double lifted_absmax = INFINITY;
  std::int64_t since = -1;
  std::int64_t zeros_until = -1;
};

FlushedSummary summarise(const std::vector<FlushedLayer>& flushed) {
  FlushedSummary s;
  s.lead = &flushed.front();
  s.since = flushed.front().since;
  for (const FlushedLayer& f : flushed) {
    s.since = std::min(s.since, f.since);
    if (f.in_range < 0) {
      s.zeros_until = std::max(s.zeros_until, f.zero_step);
      if (s.lead->in_range >= 0) s.lead = &f;
    }
  }
  if (s.lead->in_range >= 0)
    for (const FlushedLayer& f : flushed) {
      s.lifted = std::max(s.lifted, f.in_range);
      s.lifted_absmax = std::min(s.lifted_absmax, f.in_range_absmax);
    }
  return s;
}

std::string flushed_evidence(const Run& run, const Thresholds& t, const std::vector<FlushedLayer>& flushed,
                             const FlushedSummary& s, const std::string& module) {
  const FlushedLayer& lead = *s.lead;
  const std::string& name = lead.layer->info.name;
  const double rms = lead.reading->l2 / std::sqrt(double(lead.layer->info.numel));
  std::string evidence =
      name + "'s largest |value| was " + three_digits(lead.reading->absmax) + " (RMS " + three_digits(rms) +
      ") at step " + std::to_string(lead.reading->step) + ", below 2^-24 (5.96e-08), float16's smallest positive value" +
      (lead.since < lead.reading->step ? ", at every reading from step " + std::to_string(lead.since) : std::string()) +
      ": cast to float16 for the matmul, those weights are 0, and " + lead.layer->info.module_path +
      "'s output was all zeros at step " + std::to_string(lead.zero_step);
  std::string more;
  std::size_t others = 0;
  for (const FlushedLayer& other : flushed)
    if (&other != &lead && others++ < 3) more += (others > 1 ? ", " : "") + other.layer->info.name;
  if (others > 3) more += " and " + std::to_string(others - 3) + " more";
  if (others > 0) evidence += "; so were " + more;
  // The agent's FP32 check of a module holding them, or inside what holds them, while they were flushed.
  for (const auto& c : run.precision_checks)
    if (c.rel_error >= t.precision_error && (rundb::within(c.module, module) || rundb::within(module, c.module)) &&
        flushed_at(flushed, c.module, c.step)) {
      evidence += "; the agent's check of " + c.module + " at step " + std::to_string(c.step) + " found its output " +
                  pct(c.rel_error) + " away from the same call in FP32";
      break;
    }
  const bool one = flushed.size() == 1;
  const auto& samples = lead.layer->samples;
  const auto finite = [](const GradSample& g) { return !g.nonfinite; };
  const auto zero_or_nonfinite = [](const GradSample& g) { return g.nonfinite || g.zero_q == 65535; };
  if (s.lifted >= 0)
    evidence += "; by step " + std::to_string(s.lifted) +
                (one ? " its largest value was " : " the smallest of their largest values was ") +
                three_digits(s.lifted_absmax) + ", which float16 holds: the steps before trained what takes " +
                (one ? "its output" : "their outputs") + " on zeros";
  else if (std::any_of(samples.begin(), samples.end(), finite) &&
           std::all_of(samples.begin(), samples.end(), zero_or_nonfinite))
    evidence += "; " + name + "'s gradient was exactly zero in every recorded step, so no optimizer step lifts it";
  else
    evidence += "; " + name + "'s last reading was still below it";
  return evidence;
}

// Their re-initialisation: of the one layer's module, or of every Linear and convolution of
// the module holding them (the model where nothing below it does), untried.
Suggestion reinitialise_flushed(const FlushedLayer& lead, bool one, const std::string& module) {
  const std::string target = one ? lead.layer->info.module_path : module;
  const std::string torch_path = "model" + (target.empty() ? std::string() : ".get_submodule(\"" + target + "\")");
  const double rms = lead.reading->l2 / std::sqrt(double(lead.layer->info.numel));
  Suggestion s{
      "Initialise " + (one ? target : "the Linear and convolution layers of " + (target.empty() ? "the model" : target)) +
          " at a standard scale (torch's default, Kaiming or Xavier, or a normal of std 0.02): at an RMS of " +
          three_digits(rms) + (one ? " its" : " their") + " weights are 0 in float16. A Hugging Face config's "
          "initializer_range does this where it is set for loading pretrained weights (the vision configs of BLIP, "
          "BLIP-2, InstructBLIP and SAM default to 1e-10): load the pretrained weights, or set "
          "initializer_range=0.02 before building the model.",
      one ? torch_path + ".reset_parameters()  # torch's default initialisation"
          : "for layer in " + torch_path + ".modules():\n"
            "    if isinstance(layer, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):\n"
            "        layer.reset_parameters()  # torch's default initialisation",
      "// where the module is made, torch's default initialisation:\nmodule->reset_parameters();", ""};
  s.untried = true;
  return s;
}

}  // namespace

void flushed_weights(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  const std::vector<FlushedLayer> flushed = flushed_layers(run);
  if (flushed.empty()) return;
  std::string holder = flushed.front().layer->info.module_path;
  for (const FlushedLayer& f : flushed) holder = rundb::common_module(holder, f.layer->info.module_path);
  const std::string module = holder.empty() ? flushed.front().layer->info.module_path : suggest::probed_module(run, holder);
  const FlushedSummary s = summarise(flushed);
  const bool one = flushed.size() == 1;
  Finding f;
  f.rule = "flushed-weights";
  f.severity = s.lifted < 0 ? Severity::kError : Severity::kWarning;
  f.score = 40.0;
  f.module = module;
  f.layer = s.lead->layer->info.name;
  f.steps = {s.since};
  f.title = (one ? f.layer + " was" : module + "'s weights were") + " below float16's smallest value (5.96e-08) from step " +
            std::to_string(s.since) + ", so autocast computed with zeros" +
            (s.lifted < 0 ? std::string(" and ") + (one ? "its output was" : "their outputs were") +
                                " all zeros through step " + std::to_string(s.zeros_until)
                          : std::string(" until the optimizer's steps lifted ") + (one ? "it" : "them") + ", by step " +
                                std::to_string(s.lifted));
  f.evidence = flushed_evidence(run, t, flushed, s, module);
  f.suggestions.push_back(reinitialise_flushed(*s.lead, one, module));
  Suggestion bf16 = suggest::use_bf16(run);
  bf16.summary = "Or train in bfloat16: it keeps float32's range, where weights this small keep their values.";
  f.suggestions.push_back(bf16);
  out.push_back(std::move(f));
}

}  // namespace ampdiag::analyzer::rules
