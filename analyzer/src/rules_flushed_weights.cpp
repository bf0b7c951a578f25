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

void flushed_weights(const Run& run, const Thresholds& t, std::vector<Finding>& out) {
  const std::vector<FlushedLayer> flushed = flushed_layers(run);
  if (flushed.empty()) return;
  std::string holder = flushed.front().layer->info.module_path;
  for (const FlushedLayer& f : flushed) holder = rundb::common_module(holder, f.layer->info.module_path);
  const std::string module = holder.empty() ? flushed.front().layer->info.module_path : suggest::probed_module(run, holder);
  std::int64_t lifted = -1;  // the step by which every one was in range; -1: some never were
  double lifted_absmax = INFINITY;
  const FlushedLayer* first = &flushed.front();  // one that stayed flushed where any did
  for (const FlushedLayer& f : flushed) {
    if (f.in_range < 0) {
      first = &f;
      lifted = -1;
      break;
    }
    lifted = std::max(lifted, f.in_range);
    lifted_absmax = std::min(lifted_absmax, f.in_range_absmax);
  }
  std::int64_t zeros_until = -1;
  for (const FlushedLayer& f : flushed)
    if (f.in_range < 0) zeros_until = std::max(zeros_until, f.zero_step);
  const std::string& name = first->layer->info.name;
  Finding f;
  f.rule = "flushed-weights";
  f.severity = lifted < 0 ? Severity::kError : Severity::kWarning;
  f.score = 40.0;
  f.module = module;
  f.layer = name;
  std::int64_t since = first->since;
  for (const FlushedLayer& other : flushed) since = std::min(since, other.since);
  f.steps = {since};
  const bool one = flushed.size() == 1;
  const std::string whose = one ? name : module + "'s weights";
  f.title = whose + (one ? " was" : " were") + " below float16's smallest value (5.96e-08) from step " +
            std::to_string(since) + ", so autocast computed with zeros" +
            (lifted < 0 ? " and " + std::string(one ? "its output was" : "their outputs were") + " all zeros through step " +
                              std::to_string(zeros_until)
                        : std::string(" until the optimizer's steps lifted ") + (one ? "it" : "them") + ", by step " + std::to_string(lifted));
  const double rms = first->reading->l2 / std::sqrt(double(first->layer->info.numel));
  f.evidence = name + "'s largest |value| was " + three_digits(first->reading->absmax) + " (RMS " + three_digits(rms) +
               ") at step " + std::to_string(first->reading->step) + ", below 2^-24 (5.96e-08), float16's smallest " +
               "positive value" + (first->since < first->reading->step ? ", at every reading from step " +
                                     std::to_string(first->since) : std::string()) +
               ": cast to float16 for the matmul, those weights are 0, and " + first->layer->info.module_path +
               "'s output was all zeros at step " + std::to_string(first->zero_step);
  std::string more;
  std::size_t others = 0;
  for (const FlushedLayer& other : flushed)
    if (&other != first && others++ < 3) more += (others > 1 ? ", " : "") + other.layer->info.name;
  if (others > 3) more += " and " + std::to_string(others - 3) + " more";
  if (others > 0) f.evidence += "; so were " + more;
  // The agent's FP32 check of a module holding them, or inside what holds them, while they were flushed.
  for (const auto& c : run.precision_checks)
    if (c.rel_error >= t.precision_error && (rundb::within(c.module, module) || rundb::within(module, c.module)) &&
        flushed_at(flushed, c.module, c.step)) {
      f.evidence += "; the agent's check of " + c.module + " at step " + std::to_string(c.step) +
                    " found its output " + pct(c.rel_error) + " away from the same call in FP32";
      break;
    }
  const auto& samples = first->layer->samples;
  const bool no_gradient =
      std::any_of(samples.begin(), samples.end(), [](const GradSample& g) { return !g.nonfinite; }) &&
      std::all_of(samples.begin(), samples.end(), [](const GradSample& g) { return g.nonfinite || g.zero_q == 65535; });
  if (lifted >= 0)
    f.evidence += "; by step " + std::to_string(lifted) + (one ? " its largest value was " : " the smallest of their largest values was ") +
                  three_digits(lifted_absmax) + ", which float16 holds: the steps before trained what takes " +
                  (one ? "its output" : "their outputs") + " on zeros";
  else if (no_gradient)
    f.evidence += "; " + name + "'s gradient was exactly zero in every recorded step, so no optimizer step lifts it";
  else
    f.evidence += "; " + name + "'s last reading was still below it";
  const std::string target = one ? first->layer->info.module_path : module;
  const std::string torch_path = "model" + (target.empty() ? std::string() : ".get_submodule(\"" + target + "\")");
  Suggestion init{
      "Initialise " + (one ? target : "the Linear and convolution layers of " + (target.empty() ? "the model" : target)) +
          " at a standard scale (torch's default, Kaiming or Xavier, or a normal of std 0.02): at an RMS of " +
          three_digits(rms) + (one ? " its" : " their") + " weights are 0 in float16. A Hugging Face config's initializer_range does this "
          "where it is set for loading pretrained weights (the vision configs of BLIP, BLIP-2, InstructBLIP and SAM default to 1e-10): load the pretrained weights, or set initializer_range=0.02 before "
          "building the model.",
      one ? torch_path + ".reset_parameters()  # torch's default initialisation"
          : "for layer in " + torch_path + ".modules():\n"
            "    if isinstance(layer, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):\n"
            "        layer.reset_parameters()  # torch's default initialisation",
      "// where the module is made, torch's default initialisation:\nmodule->reset_parameters();", ""};
  init.untried = true;
  f.suggestions.push_back(init);
  Suggestion bf16 = suggest::use_bf16(run);
  bf16.summary = "Or train in bfloat16: it keeps float32's range, where weights this small keep their values.";
  f.suggestions.push_back(bf16);
  out.push_back(std::move(f));
}

}  // namespace ampdiag::analyzer::rules
