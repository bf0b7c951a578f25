// Copy-paste fixes, with the exact module path in them.
#pragma once

#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::suggest {

// "block1.0.attn" -> "model.block1[0].attn"
std::string python_attribute(const std::string& module_path);
// The run's autocast device_type: "cuda" or "cpu".
std::string device_type(const Run& run);
// The same device as LibTorch's C++ snippets name it: "at::kCUDA" or "at::kCPU".
std::string cpp_device_type(const Run& run);
// Whether the Python agent wrote the run (its fixes are Python; the C++ agent's, LibTorch).
bool python_agent(const Run& run);

Suggestion pin_fp32(const Run& run, const std::string& module_path);
// `first` and `second` pinned together ("Run a and b in FP32 ..."), `why` ending the summary;
// `more`: further modules pinned with them, in the snippets ("c sent them too" is the caller's).
Suggestion pin_fp32_both(const Run& run, const std::string& first, const std::string& second, const std::string& why,
                         const std::vector<std::string>& more = {});
Suggestion use_bf16(const Run& run);
// Whether an FP32 replay's largest output `fp32_absmax` is beyond the run's fp16 range.
bool beyond_fp16(const Run& run, double fp32_absmax);
// The fixes for a module whose FP32 replay was finite, up to `fp32_absmax`: its pin, then
// bf16 (fp16 runs). Beyond fp16's range, the module pinned alone would hand that to whatever
// uses its output, which overflows there instead where it runs in fp16 (timm ViT's mlp.fc1
// then fc2; T5's wo feeds a float32 residual sum, and alone is enough): its parent is pinned,
// with those users inside it (untried), or with no parent bf16 comes first.
std::vector<Suggestion> confirmed_fixes(const Run& run, const std::string& module_path, double fp32_absmax);
// The module to pin with `module_path` where its FP32 output is beyond fp16's range, so that
// what uses that output runs in FP32 too; empty where there is none (a top-level module).
std::string range_parent(const Run& run, const std::string& module_path);
Suggestion add_scaler(const Run& run);
// Parameters kept in float32, the forward under autocast (the model stored them in fp16/bf16).
Suggestion fp32_master_weights(const Run& run);
// The model's own code `after` its last submodule ("after norm, its last submodule") run
// in FP32; `ops` the half-precision operations it ran ("Mul and Mm"), or empty. `code` and
// `where` name that code and where it is for another place (the loss code, where the loss
// is computed).
Suggestion fp32_model_code(const Run& run, const std::string& after, const std::string& ops,
                           const std::string& code = "the model's own code",
                           const std::string& where = "in the model's forward()");
// "Look first at the backward of `suspects`": a function whose gradient is infinite where it
// is evaluated (sqrt of 0), also behind a torch.where that masks such values; no pin helps.
Suggestion singular_backward(const std::string& suspects);
// How singular_backward's summary begins, before the suspects.
inline constexpr char kSingularLook[] = "Look first at the backward of ";
// The loss computed in FP32 from the model's output; `why` leads the summary.
Suggestion fp32_loss(const std::string& why);
Suggestion scaler_settings(const Run& run, double init_scale, std::int64_t growth_interval, const std::string& why);

// `module` re-initialised at a standard scale, untried. Where `gain` > 0, as another finding's
// first fix: its weights started at that gain (oversized-weights), and `so` says what it made
// ("its outputs reach 21088, ..."); else as oversized-weights gives it, beside an overflow's own fixes.
// A module whose weight a parametrization computes (weight_norm, spectral_norm) is given the
// new weight through it. `stacked`: the module's attribute holding an MoE's stacked experts
// (gate_up_proj), which has no reset_parameters() and is initialised as Hugging Face does.
Suggestion reinitialise(const Run& run, const std::string& module, double gain = 0.0, const std::string& so = "",
                        const std::string& stacked = "");

// The module to act on for a parameter: the innermost probed module containing it, else
// the parameter's own module.
std::string module_for_layer(const Run& run, const rundb::LayerRow& layer);

// The same for a module path: the innermost probed module holding it, itself where it was
// probed, else the path. A module holding parameters that the agent never saw run (torch's
// MultiheadAttention calls F.linear on its out_proj's weights, not out_proj's forward) is
// acted on, pinned, through the module that uses them.
std::string probed_module(const Run& run, const std::string& path);

// A parameter the optimizer steps that is no parameter of the attached model (another
// model's: a GAN's discriminator attached without it). The agent names it "optimizer.paramN".
bool outside_model(const rundb::LayerRow& layer);
// Where `layer`'s gradient overflows, for a title: `module` (with its type where its last
// part is "model": Hugging Face's LlamaForCausalLM holds a LlamaModel at "model", which
// alone reads as the whole model), or, where no module holds it (module empty), "the
// model's own forward(), where it uses X" or "X, a parameter outside the attached model".
std::string place_of(const Run& run, const std::string& module, const rundb::LayerRow& layer);
// The fix for that place: pin_fp32(module); or, with no module, autocast off around the
// model's own code that uses the parameter, or attaching the model that holds it.
Suggestion fp32_at(const Run& run, const std::string& module, const rundb::LayerRow& layer);

// Whether `path` is `module` or a path inside it, by whole components ("a.bc" is not in "a.b").
bool within(const std::string& path, const std::string& module);

}  // namespace ampdiag::analyzer::suggest
