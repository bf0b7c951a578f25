// oversized-weights: a layer whose weights were already far larger than any standard
// initialisation makes them at the first step the agent read them (weight_norms). Kaiming
// and Xavier initialisations, torch's defaults and GPT-style normal(0, 0.02) all give a
// root-mean-square weight of about 0.5 to 3 over the square root of the fan-in, so that a
// layer keeps its input's scale; weights a hundred times that make outputs a hundred times
// their input, which the next layers in fp16 cannot hold (a custom init's std=1 on a wide
// layer, a checkpoint saved at another scale, a weight multiplied by mistake). The module
// that overflows is where it shows, not why; weight-growth covers weights that grew there.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "overflow_events.h"
#include "rules.h"
#include "suggestions.h"

namespace ampdiag::analyzer::rules {

// "[256, 64, 3, 3]" as numbers; empty where it is not such a list.
std::vector<std::int64_t> dims_of(const std::string& shape) {
  std::vector<std::int64_t> dims;
  if (shape.size() < 2 || shape.front() != '[' || shape.back() != ']') return {};
  const char* p = shape.c_str() + 1;
  while (*p != ']') {
    char* end = nullptr;
    const long long d = std::strtoll(p, &end, 10);
    if (end == p || d <= 0) return {};
    dims.push_back(d);
    p = end;
    while (*p == ',' || *p == ' ') ++p;
  }
  return dims;
}

std::map<std::int64_t, const rundb::WeightNormRow*> first_weight_norms(const Run& run) {
  std::map<std::int64_t, const rundb::WeightNormRow*> first;
  for (const auto& w : run.weight_norms) {
    auto& at = first[w.layer_id];
    if (at == nullptr || w.step < at->step) at = &w;
  }
  return first;
}

double mean_weight_rms(const Run& run, const LayerSummary& layer) {
  if (layer.info.numel <= 0) return 0.0;
  double sum = 0.0;
  std::int64_t rows = 0;
  for (const auto& w : run.weight_norms)
    if (w.layer_id == layer.info.id && std::isfinite(w.l2)) {
      sum += w.l2 / std::sqrt(double(layer.info.numel));
      ++rows;
    }
  return rows == 0 ? 0.0 : sum / double(rows);
}

bool weight_named(const std::string& name) {
  const std::size_t dot = name.rfind('.');
  return name.find("weight", dot == std::string::npos ? 0 : dot) != std::string::npos ||
         name.find(".weight.") != std::string::npos;
}

std::vector<std::pair<std::string, std::int64_t>> shared_names(const Run& run) {
  static const std::string kAs = " is the same tensor as layer ";
  std::vector<std::pair<std::string, std::int64_t>> names;
  for (const auto& e : run.events) {
    const std::size_t at = e.kind == "shared-parameter" ? e.detail.find(kAs) : std::string::npos;
    if (at != std::string::npos) names.emplace_back(e.detail.substr(0, at), std::atoll(e.detail.c_str() + at + kAs.size()));
  }
  return names;
}

// Values from which a matrix's gain is read: a head of 16 inputs and 4 outputs (a box
// regressor) has 64, and its gain is as telling as a wide layer's; below, a handful of values
// (a 2 x 2 mixing matrix) says little.
constexpr std::int64_t kFewestValues = 16;

bool weight_matrix(const rundb::LayerRow& layer) {
  // Not a table whose rows are looked up or added, not summed over: an embedding's (torch
  // initialises them at 1), a position embedding or class token held as a plain parameter
  // (vit-pytorch's torch.randn(1, 65, dim)). Biases and norms' scales have no fan-in.
  return dims_of(layer.shape).size() >= 2 && layer.numel >= kFewestValues &&
         layer.module_type.find("Embedding") == std::string::npos && weight_named(layer.name);
}

namespace {

// RMS times the square root of the fan-in from which a layer's weights count as oversized:
// 45 times Kaiming-normal's sqrt(2), over 100 times torch's default for Linear and Conv.
constexpr double kOversized = 64.0;
// Calibration skips from which the scaler's own descent counts as an overflow the layer
// explains: a healthy run usually backs off from 65536 once or twice, not down to 2^12 or below.
constexpr std::int64_t kDeepCalibration = 4;

struct Oversized {
  const LayerSummary* layer = nullptr;
  double scale = 0.0;  // RMS * sqrt(fan-in) at its first reading
  std::int64_t step = 0;
  std::string module;  // the module to re-initialise: the Linear that uses a tied table
  std::string name;    // as findings name it
  std::string stacked;  // a stacked experts' weight: its attribute on the module (gate_up_proj)
};

// One parameter holding every expert's matrix, [experts, out, in] (Mixtral's, Qwen's in
// Hugging Face's fused MoE) or [experts, in, out] (Llama 4's), in the module of the experts:
// weight-named or not (gate_up_proj), its gain is each matrix's. Phimoe's experts 3e4 times
// too large had gone unnamed beside the underflows they caused.
bool stacked_experts(const rundb::LayerRow& layer) {
  const std::size_t dot = layer.module_path.rfind('.');
  const std::string last = dot == std::string::npos ? layer.module_path : layer.module_path.substr(dot + 1);
  return dims_of(layer.shape).size() == 3 && layer.numel >= kFewestValues &&
         (last == "experts" || layer.module_type.find("Experts") != std::string::npos);
}

// The fan-in a layer's gain is read with: an experts' stack's is the smaller of each matrix's
// two dimensions, since which is the input depends on the model; it never overstates the gain.
double fan_in_of(const rundb::LayerRow& layer, const std::vector<std::int64_t>& dims) {
  if (stacked_experts(layer)) return double(std::min(dims[1], dims[2]));
  return double(layer.numel) / double(dims.front());
}

// The Linear that uses an embedding's table as its own weight (shared_names), its weight's
// name; empty where none does. Tied to the embedding, an LM head's weight is recorded under
// the embedding's name, which no fan-in sums over: BART's lm_head 3e4 times too large, a loss
// of 36000 that did not move, had been called healthy.
std::string tied_linear_use(const Run& run, const LayerSummary& table) {
  for (const auto& [name, layer] : shared_names(run)) {
    if (layer != table.info.id) continue;
    const std::size_t dot = name.rfind('.');
    const ModuleSummary* user = dot == std::string::npos ? nullptr : run.module_named(name.substr(0, dot));
    if (user != nullptr && user->info.module_type.find("Linear") != std::string::npos && weight_named(name))
      return name;
  }
  return "";
}

std::string whole_number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f", v);
  return b;
}

// The layers whose weights were oversized at their first reading, the largest gain first.
std::vector<Oversized> oversized_layers(const Run& run) {
  std::vector<Oversized> found;
  for (const auto& [id, w] : first_weight_norms(run)) {
    const LayerSummary& layer = run.layers[std::size_t(id)];
    const std::string tied = weight_matrix(layer.info) || dims_of(layer.info.shape).size() != 2
                                 ? std::string()
                                 : tied_linear_use(run, layer);
    const bool stacked = stacked_experts(layer.info);
    if (!weight_matrix(layer.info) && !stacked && tied.empty()) continue;
    const double fan_in = fan_in_of(layer.info, dims_of(layer.info.shape));
    const double scale = w->l2 / std::sqrt(double(layer.info.numel)) * std::sqrt(fan_in);
    if (scale < kOversized) continue;
    if (tied.empty())
      found.push_back({&layer, scale, w->step, suggest::module_for_layer(run, layer.info), layer.info.name,
                       stacked ? layer.info.name.substr(layer.info.name.rfind('.') + 1) : ""});
    else
      found.push_back({&layer, scale, w->step, tied.substr(0, tied.rfind('.')),
                       tied + " (the same tensor as " + layer.info.name + ")", ""});
  }
  std::stable_sort(found.begin(), found.end(), [](const Oversized& a, const Oversized& b) { return a.scale > b.scale; });
  return found;
}

}  // namespace

std::optional<Suggestion> reinitialise_for_outputs(const Run& run, const std::string& maker, double reach,
                                                   double loss) {
  const std::vector<Oversized> found = oversized_layers(run);
  if (found.empty()) return std::nullopt;
  for (const Oversized& o : found)
    if (o.module == maker)
      return suggest::reinitialise(run, o.module, o.scale,
                                   "its outputs reach " + fmt(reach) + ", the loss is around " + fmt(loss) +
                                       ", and the gradients that pass back through it are as large",
                                   o.stacked);
  return suggest::reinitialise(run, found.front().module, found.front().scale,
                               "what it makes is about that many times its input, and the loss (around " + fmt(loss) +
                                   ") and the gradients of the layers after it are as large",
                               found.front().stacked);
}

std::optional<Suggestion> reinitialise_sender(const Run& run, const std::string& sender, const std::string& receiver) {
  for (const Oversized& o : oversized_layers(run))
    if (o.module == sender)
      return suggest::reinitialise(run, o.module, o.scale,
                                   "the gradient its backward sends back to " + receiver +
                                       " is about that many times the one it receives",
                                   o.stacked);
  return std::nullopt;
}

std::optional<Suggestion> sender_code_fix(const Run& run, const std::string& sender, const std::string& receiver) {
  if (sender.empty() || holds_parameters(run, sender)) return std::nullopt;
  // torch's own modules without parameters (an activation, a pooling) enlarge a gradient by
  // their derivative at most, which their type says: the overflow's other fixes stay first.
  const ModuleSummary* m = run.module_named(sender);
  if (m == nullptr || m->info.source.find("/torch/nn/") != std::string::npos ||
      m->info.source.find("\\torch\\nn\\") != std::string::npos)
    return std::nullopt;
  Suggestion s;
  s.summary = "Look at " + sender + "'s backward: it holds no parameters, so what enlarges the gradient it sends back "
              "to " + receiver + " is its own code: a custom autograd.Function whose backward multiplies the gradient "
              "(a gradient reversal layer's -lambda * grad with lambda far above 1), a constant factor, a division by "
              "a small value. Bring that factor down: every layer before " + sender + " takes gradients that many "
              "times too large, which no loss scale fits and a lower learning rate only offsets.";
  s.python = "class GradReverse(torch.autograd.Function):\n"
             "    @staticmethod\n"
             "    def backward(ctx, grad):\n"
             "        return -ctx.lam * grad, None  # lambda of about 1 (DANN ramps it from 0 to 1)";
  s.untried = true;
  return s;
}

std::optional<SenderCode> sender_code_in(const Run& run, const std::vector<Finding>& out, const std::string& module) {
  for (const Finding& o : out) {
    if (o.rule != "overflow-origin" || o.module.empty() || (!module.empty() && o.module != module)) continue;
    const GradientSenders senders = gradient_senders(run, o.module);
    if (senders.paths.empty()) continue;
    const std::optional<Suggestion> code = sender_code_fix(run, senders.paths.front(), o.module);
    if (code && std::any_of(o.suggestions.begin(), o.suggestions.end(),
                            [&](const Suggestion& s) { return s.summary == code->summary; }))
      return SenderCode{o.module, senders.paths.front(), senders.step, *code};
  }
  return std::nullopt;
}

void by_design(Suggestion& pin) {
  // "Run ...", "Train in bfloat16 ..." continue the sentence.
  pin.summary[0] = char(std::tolower(static_cast<unsigned char>(pin.summary[0])));
  pin.summary = "Where that gain is by design, " + pin.summary;
}

bool lead_the_look(const Suggestion& reinit, double true_max, double fp_max, Finding& f) {
  const std::string look = suggest::kSingularLook;
  const auto it = std::find_if(f.suggestions.begin(), f.suggestions.end(),
                               [&](const Suggestion& s) { return s.summary.rfind(look, 0) == 0; });
  if (it == f.suggestions.end()) return false;
  it->summary = "If the gain is not the whole cause, look at the backward of " + it->summary.substr(look.size());
  f.suggestions.insert(it, reinit);
  f.evidence += "; in the steps where they stayed finite its gradients reached " + fmt(true_max) + " unscaled, " +
                std::to_string(std::lround(100.0 * true_max / fp_max)) + "% of fp16's " + fmt(fp_max);
  return true;
}

std::optional<Suggestion> reinitialise_after(const Run& run, const std::string& module,
                                             const std::set<std::string>& ran_before, bool* inside) {
  if (module.empty()) return std::nullopt;
  for (const Oversized& o : oversized_layers(run)) {
    const std::string& maker = o.module;
    // Where both were probed their places in forward decide; else the backward's order: a
    // module whose gradient arrived before `module`'s NaN/Inf one ran after it in forward.
    // A layer inside `module` is in its backward whatever the places (a child finishes first).
    const bool in_module = suggest::within(maker, module);
    const bool after = in_module || (run.module_named(module) && run.module_named(maker)
                                         ? run.finishes_at_or_after(maker, module)
                                         : ran_before.count(maker) > 0);
    if (maker.empty() || !after) continue;
    if (inside) *inside = in_module;
    return suggest::reinitialise(run, maker, o.scale,
                                 maker == module ? "its outputs, and the gradients that follow from them, are about "
                                                   "that many times larger"
                                 : in_module     ? "the gradients that pass back through it, into the rest of " + module +
                                                       ", are about that many times larger"
                                                 : "the gradients that pass back through it, down to " + module +
                                                       "'s, are about that many times larger",
                                 o.stacked);
  }
  return std::nullopt;
}

void oversized_weights(const Run& run, std::vector<Finding>& out) {
  const std::vector<Oversized> found = oversized_layers(run);
  if (found.empty()) return;
  const Oversized& top = found.front();
  const std::string& module = top.module;

  // Its outputs are large from it on in forward, and the gradients that pass back through it
  // are as large before it: it explains a forward overflow at or after it, and a backward
  // one anywhere. The gravest such finding is named, a forward one first among equals: its
  // outputs are what the gain enlarges (a head 1e4 times too large whose own output
  // overflows, beside the backbone's gradients that overflow from its loss).
  // An information overflow-origin counts only where some skips were not the scaler's own
  // calibration or probing, or the calibration went deeper than a healthy run's: a back-off
  // or two from 65536 happens in a healthy run of the same model too.
  const Finding* explained = nullptr;
  const bool probed = run.module_named(module) != nullptr;
  const std::int64_t calibration = calibration_skips(run);
  const bool harmful = harmful_skips(run) > 0;
  const bool deep = !harmful && calibration >= kDeepCalibration;
  // A NaN/Inf loss where no module output was probed (a LibTorch model no agent.probe() or
  // forward() watched) comes after every layer in forward: the gain reaches it.
  const auto unplaced_loss = [&run](const Finding& f) {
    return f.rule == "forward-nonfinite" && f.module.empty() && run.modules.empty();
  };
  // The model's own code that made a forward NaN/Inf runs after the module that finished just
  // before it (a VAE's exp(0.5 * logvar) after a logvar head that starts too large).
  const auto own_code = [](const Finding& f) { return f.rule == "forward-nonfinite" && f.module.empty() && !f.made_after.empty(); };
  for (const Severity severity : {Severity::kError, Severity::kWarning, Severity::kInfo})
    for (const char* rule : {"forward-nonfinite", "overflow-origin"})
      for (const auto& f : out) {
        if (explained || f.severity != severity || (f.module.empty() && !unplaced_loss(f) && !own_code(f)) ||
            f.rule != rule || (severity == Severity::kInfo && !harmful && !deep))
          continue;
        const std::string& at = own_code(f) ? f.made_after : f.module;
        if (f.rule == "overflow-origin" || !probed || !run.module_named(at) || run.finishes_at_or_after(at, module))
          explained = &f;
      }
  // Where the explained finding is: a module, or the model's own code after one.
  const std::string place = !explained ? ""
                            : own_code(*explained) ? "the model's own forward() after " + explained->made_after
                                                   : explained->module;

  // Where nothing overflowed: underflowing gradients of modules whose outputs are far smaller
  // than its own. Summed with theirs into a residual stream that a norm then divides (a
  // pre-norm transformer's), a branch this large divides every other gradient the stream
  // carries by about its size: Phi's fc2 at a gain of 6844 leaves the attention's key bias
  // 81% subnormal. The underflow findings get its re-initialisation first.
  std::vector<std::string> shrunk;
  const ModuleSummary* big = explained ? nullptr : run.module_named(module);
  constexpr double kDominates = 100.0, kLarge = 256.0;
  for (auto& g : out) {
    if (!big || !(big->max_absmax >= kLarge) || g.rule != "underflow" || g.severity == Severity::kInfo ||
        g.module == module || suggest::within(g.module, module))
      continue;
    const ModuleSummary* small = run.module_named(g.module);
    if (!small || !(small->max_absmax > 0.0f) || big->max_absmax < kDominates * small->max_absmax) continue;
    const std::string times = fmt(std::round(double(big->max_absmax / small->max_absmax)));
    g.evidence += "; " + module + "'s weights start at a gain of " + whole_number(top.scale) +
                  " (see oversized-weights), and its outputs reach " + fmt(big->max_absmax) + ", " + times + " times " +
                  g.module + "'s: summed into a residual stream that a norm then divides, a branch that large shrinks "
                  "the gradients of everything else the stream carries by about as much";
    g.suggestions.insert(g.suggestions.begin(),
                         suggest::reinitialise(run, module, top.scale,
                                               "the other branches' gradients shrink by about as much where a norm "
                                               "divides the sum",
                                               top.stacked));
    shrunk.push_back(g.layer.empty() ? g.module : g.layer);
  }

  // Where no underflow follows from it: its own gradient mostly exact zeros (a quarter of its
  // values or more, on average over its finite samples). A gain this large pushes what takes
  // its outputs to its limits, a tanh or a softmax, where the gradient is 0 in any
  // precision: nanochat's logits softcapped by tanh at 15 under an lm_head 3e4 times too
  // large, its loss at 20 against ln(256) and its head's gradient 54% zeros, was called
  // healthy.
  const auto zero_share = [](const LayerSummary& layer) {
    std::int64_t finite = 0;
    double zeros = 0.0;
    for (const auto& g : layer.samples) {
      if (g.nonfinite) continue;
      zeros += double(g.zero_q) / 65535.0;
      ++finite;
    }
    return finite > 0 ? zeros / double(finite) : 0.0;
  };
  constexpr double kSaturated = 0.25;
  const double top_zeros = zero_share(*top.layer);
  const double saturated = shrunk.empty() && top_zeros >= kSaturated ? top_zeros : 0.0;
  // Or what takes its outputs loses them to fp16 (see precision-loss): a hand-written norm whose
  // x.pow(2) passes 65504 on outputs that large divides by Inf and returns its bias alone, so
  // the gradient back through it is 0 whatever its input.
  Finding* lossy = nullptr;
  if (saturated > 0.0) {
    const InputsFrom from = inputs_from(run);
    for (auto& g : out)
      if (g.rule == "precision-loss" && g.severity != Severity::kInfo && takes_output_of(run, from, g.module, module)) {
        lossy = &g;
        break;
      }
  }

  // Underflowing gradients in the module of such a weight, its gradient saturated too, are the
  // same saturation's: the limits' gradient is 0 or next to it in any precision, so most of
  // their zeros and subnormals are not fp16's, and bfloat16 would leave them (GPT-2's c_attn at
  // a gain of 112: its fused query, key and value bias 41% zero and 13% subnormal).
  std::vector<std::string> saturating;
  for (auto& g : out) {
    // (One a weight elsewhere shrank leads with that weight's re-initialisation already.)
    if (g.rule != "underflow" || g.severity == Severity::kInfo ||
        std::find(shrunk.begin(), shrunk.end(), g.layer.empty() ? g.module : g.layer) != shrunk.end())
      continue;
    const auto maker = std::find_if(found.begin(), found.end(), [&](const Oversized& o) { return o.module == g.module; });
    const double zeros = maker == found.end() ? 0.0 : zero_share(*maker->layer);
    if (zeros < kSaturated) continue;
    g.evidence += "; " + maker->module + "'s weights start at a gain of " + whole_number(maker->scale) +
                  " (see oversized-weights), and " + pct(zeros) + " of their own gradient was "
                  "exactly zero: outputs that many times too large push what takes them, a softmax or a tanh, to its "
                  "limits, where the gradient is 0 or next to it in any precision, so most of these values are not "
                  "fp16's to lift";
    g.suggestions.insert(g.suggestions.begin(),
                         suggest::reinitialise(run, maker->module, maker->scale,
                                               "what takes its outputs saturates, and the gradients back through it "
                                               "are 0 or next to it in any precision",
                                               maker->stacked));
    if (g.suggestions.size() > 1 && g.suggestions[1].summary.rfind("Train in bfloat16", 0) == 0)
      g.suggestions[1].summary.replace(0, 5, "Or train");
    saturating.push_back(g.layer.empty() ? g.module : g.layer);
  }

  // An occasional overflow the scaler copes with (information) still weighs where it holds
  // the scale down enough for scale-collapse or skip-rate to speak.
  bool scale_hurt = false;
  for (const auto& g : out)
    scale_hurt = scale_hurt || ((g.rule == "scale-collapse" || g.rule == "skip-rate") && g.severity != Severity::kInfo);
  const bool occasional = explained && explained->severity == Severity::kInfo;
  const bool weighs = explained && (!occasional || scale_hurt);
  // The saturation leads where no overflow it explains weighs: the scaler's calibration it
  // also brought on is said in the evidence.
  const bool saturation_leads = saturated > 0.0 && !weighs;

  Finding f;
  f.rule = "oversized-weights";
  f.layer = top.layer->info.name;
  f.module = module;
  f.steps.push_back(top.step);
  // A warning beside the overflow's own finding, which keeps its fixes: a gain this large is
  // what makes outputs large, but a model may have it by design (trainable Fourier features).
  const bool warns = weighs || !shrunk.empty() || saturated > 0.0 || !saturating.empty();
  f.severity = warns ? Severity::kWarning : Severity::kInfo;
  f.score = warns ? 60.0 : 5.0;
  f.title = top.name + " starts at a gain of " + whole_number(top.scale) +
            ", far above any standard initialisation's" +
            (saturation_leads ? ": " + pct(saturated) + " of its own gradient was exactly zero, " +
                                    (lossy ? "and " + lossy->module + ", which takes its outputs, loses its output to "
                                             "float16"
                                           : std::string("what takes its outputs saturated"))
             : explained && unplaced_loss(*explained) ? ": the NaN/Inf loss likely follows from it"
             : explained && occasional && deep
                 ? ": the overflows at " + place + " that brought the loss scale down " +
                       plural(calibration, "halving") + " at the start likely follow from it"
             : explained ? ": the " + std::string(occasional ? "occasional " : "") + "overflow " +
                               (own_code(*explained) ? "in " : "at ") + place + " likely follows from it"
             : !shrunk.empty() ? ": the underflow in " + shrunk.front() +
                                     (shrunk.size() > 1 ? " and " + plural(std::int64_t(shrunk.size() - 1), "more layer")
                                                        : std::string()) +
                                     " likely follows from it"
             : harmful || calibration > 0 ? ", and no overflow follows from it"
                                          : ", and nothing overflowed");
  const std::vector<std::int64_t> dims = dims_of(top.layer->info.shape);
  const std::string each =
      top.stacked.empty() ? ""
                          : " (each of its " + std::to_string(dims.front()) + " experts' matrices, the fan-in taken as "
                            "the smaller of their two dimensions, " + std::to_string(std::min(dims[1], dims[2])) + ")";
  f.evidence = "at step " + std::to_string(top.step) +
               " its gain, the root-mean-square value times the square root of its fan-in" + each + ", was " +
               fmt(top.scale) + " (Kaiming, Xavier and torch's default initialisations give 0.6 to 1.4: a layer that "
               "keeps its input's scale), so its outputs are about that many times its inputs";
  for (std::size_t i = 1; i < found.size() && i < 4; ++i)
    f.evidence += (i == 1 ? "; also " : ", ") + found[i].name + " (" + fmt(found[i].scale) + ")";
  if (found.size() > 4) f.evidence += " and " + plural(std::int64_t(found.size() - 4), "more layer");
  if (explained && unplaced_loss(*explained))
    f.evidence += "; the loss went NaN/Inf, and no module output was probed to say where it started (see "
                  "forward-nonfinite)";
  else if (explained)
    f.evidence += "; " + place + (explained->rule == "forward-nonfinite" ? " went NaN/Inf in forward"
                                                                                      : "'s gradients overflowed first") +
                  " (see " + explained->rule + ")";
  if (!shrunk.empty())
    f.evidence += "; its outputs reach " + fmt(big->max_absmax) + ", at least " + whole_number(kDominates) +
                  " times those of the modules whose gradients underflow (see underflow)";
  if (saturated > 0.0 && lossy)
    f.evidence += "; on average " + pct(saturated) + " of its gradient's values were exactly zero: " + lossy->module +
                  ", which takes its outputs, loses its output to float16 on values that many times too large (see "
                  "precision-loss), where an intermediate inside it passes fp16's range and its output no longer "
                  "follows its input, so the gradient back through it is 0 there, and it and the layers before it "
                  "barely train whatever the loss scale";
  else if (saturated > 0.0)
    f.evidence += "; on average " + pct(saturated) + " of its gradient's values were exactly zero: outputs that many "
                  "times too large push what takes them to its limits, a tanh or a softmax, where the gradient is 0 "
                  "in any precision, so it and the layers before it barely train whatever the loss scale";
  if (!saturating.empty())
    f.evidence += "; the underflow in " + saturating.front() +
                  (saturating.size() > 1 ? " and " + plural(std::int64_t(saturating.size() - 1), "more layer") : "") +
                  " is that saturation's too (see underflow)";
  if (explained || warns) f.suggestions.push_back(suggest::reinitialise(run, module, 0.0, "", top.stacked));
  if (lossy) {
    lossy->evidence += "; its input comes from " + module + ", whose weights start at a gain of " +
                       whole_number(top.scale) + " (see oversized-weights)";
    Suggestion reinit = suggest::reinitialise(run, module, top.scale,
                                              "its outputs are that many times what " + lossy->module +
                                                  " was written for, and in float16 it loses them",
                                              top.stacked);
    reinit.summary.replace(0, 10, "Or initialise");
    lossy->suggestions.push_back(reinit);
  }
  if (saturated > 0.0 && !explained) {  // no overflow's fixes to fall back on
    std::string& summary = f.suggestions.back().summary;
    const std::string by_design = " Where the gain is by design, the overflow's own fixes apply.";
    if (const std::size_t at = summary.find(by_design); at != std::string::npos) summary.erase(at, by_design.size());
  }
  if (!explained && !shrunk.empty()) {
    std::string& by_design = f.suggestions.back().summary;
    const std::string overflow = "the overflow's own fixes";
    if (const std::size_t at = by_design.find(overflow); at != std::string::npos)
      by_design.replace(at, overflow.size(), "the underflow's own fixes");
  }
  out.push_back(f);
}

}  // namespace ampdiag::analyzer::rules
