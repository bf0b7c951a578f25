// suggestions.h: the snippets a user pastes to apply a fix.
#include "suggestions.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/rundb/module_paths.h"
#include "device_profile.h"
#include "loss_code.h"
#include "rules.h"

namespace ampdiag::analyzer::suggest {

std::string device_type(const Run& run) {
  const std::string device = run.meta_or("device", "cuda");
  return device.rfind("cuda", 0) == 0 ? "cuda" : "cpu";
}

std::string cpp_device_type(const Run& run) { return device_type(run) == "cuda" ? "at::kCUDA" : "at::kCPU"; }

namespace {

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace

std::string python_attribute(const std::string& module_path) {
  std::string out = "model";
  std::size_t begin = 0;
  while (begin <= module_path.size() && !module_path.empty()) {
    const auto dot = module_path.find('.', begin);
    const std::string part = module_path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    if (all_digits(part)) out += "[" + part + "]";
    else if (python_identifier(part)) out += "." + part;
    // A ModuleDict key that is no identifier ("my layer"): only get_submodule reaches it,
    // and the path goes into the code as a string literal, never as code.
    else return "model.get_submodule(" + python_string(module_path) + ")";
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return out;
}

namespace {

bool floating_dtype(const std::string& t) { return t == "float16" || t == "bfloat16" || t == "float32" || t == "float64"; }

// The call with each floating-point input cast to float32 and the rest as they are, from
// what the agent saw the module take ("float16, int64"); unknown inputs: one x.float().
std::string call_arguments(const std::string& inputs) {
  if (inputs.empty()) return "x.float()";
  std::string out;
  std::size_t begin = 0, n = 0, tensors = 0, ids = 0;
  while (begin <= inputs.size()) {
    auto comma = inputs.find(", ", begin);
    const std::string t = inputs.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    std::string arg;
    if (floating_dtype(t))
      arg = (tensors++ ? "x" + std::to_string(tensors) : std::string("x")) + ".float()";
    else if (t.rfind("int", 0) == 0 || t.rfind("uint", 0) == 0)
      arg = ids++ ? "ids" + std::to_string(ids) : std::string("ids");
    else if (t == "bool")
      arg = "mask";
    else
      arg = "arg" + std::to_string(n);
    out += (n++ ? ", " : "") + arg;
    if (comma == std::string::npos) break;
    begin = comma + 2;
  }
  return out;
}

// The nearest module above `module_path` that ran (it has a row in the modules table): the
// one whose forward() calls it, since a ModuleList or ModuleDict between them has no
// forward. "" where none did.
std::string ran_ancestor(const Run& run, const std::string& module_path) {
  for (auto dot = module_path.rfind('.'); dot != std::string::npos;
       dot = dot == 0 ? std::string::npos : module_path.rfind('.', dot - 1)) {
    const std::string above = module_path.substr(0, dot);
    if (run.module_named(above)) return above;
  }
  return "";
}

}  // namespace

bool python_agent(const Run& run) { return run.meta_or("source", "") == "ampdiag Python agent"; }

Suggestion pin_fp32(const Run& run, const std::string& module_path) {
  Suggestion s;
  s.summary = "Run " + module_path + " in FP32: autocast off around it, its floating-point inputs cast to float32.";
  const std::string attr = python_attribute(module_path);
  const ModuleSummary* m = run.module_named(module_path);
  const std::string args = call_arguments(m ? m->info.inputs : "");
  const auto dot = module_path.rfind('.');
  const std::string last = dot == std::string::npos ? module_path : module_path.substr(dot + 1);
  // Where the Python agent watched every module that ran and none above it did (a block in
  // the model's ModuleList), the model's forward() calls it; else the path above it.
  std::string parent = ran_ancestor(run, module_path);
  if (parent.empty())
    parent = dot == std::string::npos || (python_agent(run) && !run.modules.empty()) ? "the model"
                                                                                     : module_path.substr(0, dot);
  // In the caller's forward(), the module is self.<its path below the caller>.
  const std::string below = parent == "the model" ? module_path : module_path.substr(parent.size() + 1);
  const std::string callee = all_digits(last) || !python_identifier(last) ? attr : "self" + python_attribute(below).substr(5);
  s.python = "ampdiag.pin_fp32(" + attr + ")  # autocast off inside it; float inputs cast, ids and masks untouched\n"
             "# or in plain torch, where " + printable(parent) + "'s forward() calls it:\n"
             "with torch.autocast(device_type=\"" + device_type(run) + "\", enabled=False):\n"
             "    out = " + callee + "(" + args + ")";
  s.cpp = "// ampdiag/pin_fp32.h\n"
          "ampdiag::Fp32Pins pins({" + cpp_string(module_path) + "});\n"
          "out = pins.run(" + cpp_string(module_path) + ", [&](const at::Tensor& in) { return module(in); }, x);";
  s.cost = pin_cost(run, module_path);
  return s;
}

Suggestion pin_fp32_both(const Run& run, const std::string& first, const std::string& second, const std::string& why,
                         const std::vector<std::string>& more) {
  Suggestion s;
  s.summary = "Run " + first + " and " + second + " in FP32 " + why;
  std::vector<std::string> all{first, second};
  all.insert(all.end(), more.begin(), more.end());
  std::string paths;
  for (const auto& path : all) {
    s.python += s.python.empty() ? "ampdiag.pin_fp32(" + python_attribute(path) + ")  # autocast off inside each; float inputs cast"
                                 : "\nampdiag.pin_fp32(" + python_attribute(path) + ")";
    paths += (paths.empty() ? "" : ", ") + cpp_string(path);
    const std::string cost = pin_cost(run, path);
    if (!cost.empty()) s.cost += (s.cost.empty() ? "" : "; ") + path + ": " + cost;
  }
  s.cpp = std::string("// ampdiag/pin_fp32.h: each call of ") + (all.size() == 2 ? "either module" : "these modules") +
          " goes through pins.run(path, ...)\nampdiag::Fp32Pins pins({" + paths + "});";
  return s;
}

Suggestion use_bf16(const Run& run) {
  Suggestion s;
  s.summary = "Or train in bfloat16 (fp32's range, no loss scaler needed) if the hardware supports it.";
  s.python = "with torch.autocast(device_type=\"" + device_type(run) + "\", dtype=torch.bfloat16):\n"
             "    loss = model(x)\n"
             "loss.backward()  # no GradScaler with bf16";
  const std::string type = cpp_device_type(run);
  s.cpp = "at::autocast::set_autocast_dtype(" + type + ", at::kBFloat16);\n"
          "at::autocast::set_autocast_enabled(" + type + ", true);";
  return s;
}

bool beyond_fp16(const Run& run, double fp32_absmax) {
  return run.fp16() && std::isfinite(fp32_absmax) && fp32_absmax > run.fp_max;
}

// The module whose call holds it: its nearest ancestor that ran (LoRA's lora_B.default sits
// in a ModuleDict, a block's layers in a ModuleList, neither of which has a forward to
// pin). Where none ran: a run of the Python agent, which watches every module, has none
// to pin; another's (the C++ agent's probes) names the path above it.
std::string range_parent(const Run& run, const std::string& module_path) {
  std::string parent = ran_ancestor(run, module_path);
  const auto dot = module_path.rfind('.');
  if (parent.empty() && dot != std::string::npos && !python_agent(run))
    parent = module_path.substr(0, dot);
  return parent;
}

std::vector<Suggestion> confirmed_fixes(const Run& run, const std::string& module_path, double fp32_absmax) {
  if (!beyond_fp16(run, fp32_absmax)) {
    std::vector<Suggestion> fixes{pin_fp32(run, module_path)};
    if (run.fp16()) fixes.push_back(use_bf16(run));
    return fixes;
  }
  const std::string parent = range_parent(run, module_path);
  if (parent.empty()) {
    Suggestion alone = pin_fp32(run, module_path);
    alone.summary = "Or run " + module_path + " in FP32 together with the code that uses its output: its FP32 output "
                    "is beyond fp16's range, so pinned alone it moves the overflow to that code where it runs in "
                    "fp16.";
    alone.untried = true;
    Suggestion bf16 = use_bf16(run);
    bf16.summary = "Train in bfloat16 (fp32's range, no loss scaler needed) if the hardware supports it: " + module_path +
                   "'s output is beyond fp16's range even in FP32.";
    bf16.untried = true;
    return {bf16, alone};
  }
  Suggestion pin = pin_fp32(run, parent);
  pin.summary = "Run " + parent + " in FP32, " + module_path + " with what uses its output: autocast off around it, its "
                "floating-point inputs cast to float32 (not replayed). " + module_path + " pinned alone hands its FP32 "
                "output, beyond fp16's range, to the code that uses it: enough where that code runs in float32 (a "
                "float32 residual sum), an overflow there where it runs in fp16 (a Linear under autocast).";
  pin.untried = true;
  return {pin, use_bf16(run)};
}

Suggestion fp32_master_weights(const Run& run) {
  const std::string device = device_type(run);
  Suggestion s;
  s.summary = "Keep FP32 master weights: leave the parameters in float32 and run the forward under autocast; "
              "the optimizer then adds each update to an FP32 weight, where it does not round away "
              "(torch.amp does this by default).";
  const std::string type = cpp_device_type(run);
  if (!run.fp16()) {
    // The run's own dtype: bfloat16 keeps fp32's range and needs no scaler.
    s.python = "model = model.float()  # before building the optimizer\n"
               "with torch.autocast(device_type=\"" + device + "\", dtype=torch.bfloat16):\n"
               "    loss = loss_fn(model(x), y)\n"
               "loss.backward(); optimizer.step()  # bfloat16 needs no GradScaler";
    s.cpp = "model->to(torch::kFloat32);  // before building the optimizer\n"
            "at::autocast::set_autocast_dtype(" + type + ", at::kBFloat16);\n"
            "at::autocast::set_autocast_enabled(" + type + ", true);";
    return s;
  }
  s.python = "model = model.float()  # before building the optimizer\n"
             "scaler = torch.amp.GradScaler(\"" + device + "\")\n"
             "with torch.autocast(device_type=\"" + device + "\", dtype=torch.float16):\n"
             "    loss = loss_fn(model(x), y)\n"
             "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()";
  s.cpp = "model->to(torch::kFloat32);  // before building the optimizer\n"
          "at::autocast::set_autocast_enabled(" + type + ", true);\n"
          "ampdiag::GradScaler scaler;";
  return s;
}

Suggestion fp32_model_code(const Run& run, const std::string& after, const std::string& ops, const std::string& code,
                           const std::string& where) {
  const std::string device = device_type(run);
  const std::string type = cpp_device_type(run);
  Suggestion s;
  s.summary = "Run " + code + " " + after + (ops.empty() ? "" : " (" + ops + ")") +
              " in FP32: autocast off around it, its inputs cast to float32. Or move that code into a module, "
              "which ampdiag then names and pin_fp32() pins.";
  s.python = "# " + where + ", around the code " + after + ":\n"
             "with torch.autocast(device_type=\"" + device + "\", enabled=False):\n"
             "    h = h.float()\n"
             "    ...  # that code, now in float32";
  s.cpp = "// " + where + ", around the code " + after + ":\n"
          "at::autocast::set_autocast_enabled(" + type + ", false);\n"
          "h = h.to(torch::kFloat);\n"
          "// ... that code, now in float32\n"
          "at::autocast::set_autocast_enabled(" + type + ", true);";
  return s;
}

Suggestion singular_backward(const std::string& suspects) {
  return {kSingularLook + suspects +
              ": a function whose gradient is infinite where it is evaluated (sqrt or norm of 0, a division by 0, log "
              "of 0) makes NaN from finite values in any precision, which pinning cannot help; keep its argument off "
              "that point (sqrt(x + 1e-12)). Behind a torch.where that masks such values (where(x > 0, x.sqrt(), 0)) "
              "it still runs on them, and their gradient comes back as 0 times NaN: clamp the argument before the "
              "operation, then select.",
          "d = (x.pow(2).sum(-1) + 1e-12).sqrt()  # sqrt(0)'s gradient is infinite\n"
          "y = torch.where(x > 0, x.clamp_min(1e-12).sqrt(), 0.0)  # not where(x > 0, x.sqrt(), 0)",
          "auto d = (x.pow(2).sum(-1) + 1e-12).sqrt();  // sqrt(0)'s gradient is infinite\n"
          "auto y = torch::where(x > 0, x.clamp_min(1e-12).sqrt(), torch::zeros_like(x));",
          ""};
}

Suggestion fp32_loss(const std::string& why) {
  Suggestion s;
  // Casting the output alone is not enough under autocast: it still runs the loss's
  // matmuls (a contrastive loss's similarities) in fp16 whatever their inputs' dtype.
  s.summary = (why.empty() ? "" : why + " ") +
              "Compute the loss in FP32: cast the model's output to float and turn autocast off around the loss "
              "(under autocast a matmul in the loss still runs in fp16).";
  s.python =
      "out = model(x)  # under autocast\n"
      "with torch.autocast(device_type=out.device.type, enabled=False):\n"
      "    loss = loss_fn(out.float(), y)";
  s.cpp =
      "auto out = model->forward(x);  // under autocast\n"
      "at::autocast::set_autocast_enabled(out.device().type(), false);\n"
      "auto loss = loss_fn(out.to(torch::kFloat), y);\n"
      "at::autocast::set_autocast_enabled(out.device().type(), true);";
  return s;
}

Suggestion add_scaler(const Run& run) {
  const rundb::EventRow* disabled = run.first_event("scaler-disabled");
  // Made for a device torch does not have here ("the GradScaler made for cuda is disabled: ..."):
  // torch turned it off, with one warning (timm's NativeScaler() defaults to cuda).
  const std::string made = "the GradScaler made for ";
  if (disabled && disabled->detail.rfind(made, 0) == 0) {
    const std::string device = disabled->detail.substr(made.size(), disabled->detail.find(' ', made.size()) - made.size());
    return {"Create the GradScaler for " + device_type(run) + ": it was made for " + device + ", which this machine "
            "does not have, so torch disabled it (torch.amp.GradScaler() and timm's NativeScaler() default to cuda), "
            "and fp16 keeps small gradients at their true size, below fp16's range.",
            "scaler = torch.amp.GradScaler(\"" + device_type(run) + "\")  # timm: NativeScaler(device=\"" +
                device_type(run) + "\")",
            "ampdiag::GradScaler scaler;"};
  }
  if (disabled)  // GradScaler(enabled=False) beside fp16 autocast: a setting left off
    return {"Enable the loss scaler: the GradScaler was created with enabled=False, so fp16 keeps small gradients at "
            "their true size, below fp16's range.",
            "scaler = torch.amp.GradScaler(\"" + device_type(run) + "\", enabled=True)  # not enabled=False with fp16",
            "ampdiag::GradScaler scaler;"};
  if (const double by_hand = loss_code::hand_scale(run); by_hand > 0.0)
    return {"Use torch.amp.GradScaler in place of the loss scale of " + rules::fmt(by_hand) + " set by hand: it scales the "
            "loss as that code does, lowers the scale where the gradients overflow and skips those steps, raises it "
            "where they fit, and ampdiag reads the gradients between its scale and unscale.",
            "scaler = torch.amp.GradScaler(\"" + device_type(run) +
                "\")\nscaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()  # no loss * S, no "
                "division of the gradients",
            "ampdiag::GradScaler scaler;"};
  return {"Use a loss scaler: fp16 without one keeps small gradients at their true size, below fp16's range.",
          "scaler = torch.amp.GradScaler(\"" + device_type(run) +
              "\")\nscaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()",
          "ampdiag::GradScaler scaler;"};
}

Suggestion scaler_settings(const Run& run, double init_scale, std::int64_t growth_interval, const std::string& why) {
  (void)run;
  char scale[64];
  std::snprintf(scale, sizeof scale, "2.0**%d", int(std::lround(std::log2(init_scale))));
  Suggestion s;
  s.summary = why;
  s.python = std::string("scaler = torch.amp.GradScaler(\"") + device_type(run) + "\", init_scale=" + scale +
             ", growth_interval=" + std::to_string(growth_interval) + ")";
  s.cpp = "ampdiag::GradScalerOptions options;\noptions.init_scale = " + std::to_string(std::lround(init_scale)) +
          ";\noptions.growth_interval = " + std::to_string(growth_interval) + ";\nampdiag::GradScaler scaler(options);";
  return s;
}

bool within(const std::string& path, const std::string& module) { return rundb::within(path, module); }

std::string module_for_layer(const Run& run, const rundb::LayerRow& layer) {
  return probed_module(run, layer.module_path);
}

std::string probed_module(const Run& run, const std::string& path) {
  std::string best;
  for (const auto& m : run.modules) {
    const std::string& p = m.info.path;
    if (p.size() > best.size() && !p.empty() && within(path, p)) best = p;
  }
  return best.empty() ? path : best;
}

namespace {

// The tensors of `module` that a parametrization computes (torch.nn.utils.parametrize holds
// their originals as "MODULE.parametrizations.NAME.original[N]"): {"weight"} for weight_norm's.
std::vector<std::string> parametrized_tensors(const Run& run, const std::string& module) {
  const std::string prefix = module + (module.empty() ? "" : ".") + "parametrizations.";
  std::vector<std::string> names;
  for (const auto& layer : run.layers) {
    if (layer.info.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = layer.info.name.substr(prefix.size(), layer.info.name.find('.', prefix.size()) - prefix.size());
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

}  // namespace

Suggestion reinitialise(const Run& run, const std::string& module, double gain, const std::string& so,
                        const std::string& stacked) {
  const std::string causes =
      "a custom initialisation with std=1 on a wide layer, a checkpoint saved at another scale, a weight multiplied by "
      "mistake.";
  std::string summary = stacked.empty() ? "Initialise " + module + " at a standard scale (torch's default, Kaiming or Xavier)"
                                        : "Initialise " + module + "." + stacked + " at a standard scale (each expert's "
                                          "matrix as one Linear's: Hugging Face's normal(0, initializer_range), Kaiming "
                                          "or Xavier)";
  if (gain > 0.0) {
    char start[32];
    std::snprintf(start, sizeof start, "%.0f", gain);
    summary += ": its weights start at a gain of " + std::string(start) + " (see oversized-weights), so " + so +
               ". Or find what made them this large: " + causes;
  } else {
    summary += ", or find what made its weights this large: " + causes +
               " Where the gain is by design, the overflow's own fixes apply.";
  }
  const std::string torch_path = "model.get_submodule(\"" + module + "\")";
  const std::vector<std::string> computed = parametrized_tensors(run, module);
  // reset_parameters() writes the initialisation into the tensor the parametrization
  // computes, a copy: the originals it is computed from keep their values.
  std::string python = torch_path + ".reset_parameters()  # torch's default initialisation (Linear, Conv)\n"
                       "# or: torch.nn.init.kaiming_uniform_(" + torch_path + ".weight, a=math.sqrt(5))";
  if (!computed.empty()) {
    const std::string& name = computed.front();
    summary += " Its " + name + " is computed by a parametrization (weight_norm, spectral_norm) from " + module +
               ".parametrizations." + name + "'s originals: assign the new " + name + " to the module, which sets "
               "them; reset_parameters() would only write into the computed copy.";
    python = "layer = " + torch_path + "\n" + name + " = torch.empty_like(layer." + name + ")\n"
             "torch.nn.init.kaiming_uniform_(" + name + ", a=math.sqrt(5))  # torch's default for Linear, Conv\n"
             "with torch.no_grad():\n    layer." + name + " = " + name + "  # through the parametrization's right_inverse";
  }
  Suggestion s{summary, python,
               "// where the module is made, torch's default initialisation:\nmodule->reset_parameters();", ""};
  if (!stacked.empty()) {  // an experts' module has no reset_parameters(); Hugging Face initialises the stack itself
    s.python = "experts = " + torch_path + "\ntorch.nn.init.normal_(experts." + stacked +
               ", std=0.02)  # the config's initializer_range, as Hugging Face initialises experts";
    s.cpp = "// where the experts are made:\ntorch::nn::init::normal_(" + stacked + ", 0.0, 0.02);";
  }
  s.untried = true;
  return s;
}

bool outside_model(const rundb::LayerRow& layer) { return layer.module_path.empty() && layer.module_type.empty(); }

std::string place_of(const Run& run, const std::string& module, const rundb::LayerRow& layer) {
  if (!module.empty()) {
    const std::size_t dot = module.rfind('.');
    const std::string last = dot == std::string::npos ? module : module.substr(dot + 1);
    const ModuleSummary* named = last == "model" ? run.module_named(module) : nullptr;
    return named && !named->info.module_type.empty() ? module + " (" + named->info.module_type + ")" : module;
  }
  if (outside_model(layer)) return layer.name + ", a parameter outside the attached model,";
  return "the model's own forward(), where it uses " + layer.name + ",";
}

Suggestion fp32_at(const Run& run, const std::string& module, const rundb::LayerRow& layer) {
  if (!module.empty()) return pin_fp32(run, module);
  if (outside_model(layer))
    return {layer.name + " " + layer.shape + " is stepped by the optimizer but belongs to no module of the attached "
                "model (another model's), so its module cannot be named or pinned: attach every model the scaler "
                "steps, in one ModuleDict, and run again.",
            "models = torch.nn.ModuleDict({\"model\": model, \"other\": other_model})\n"
            "handle = ampdiag.attach(models, scaler, db=\"run.db\")",
            "", ""};
  // A parameter of the model itself (a CLIP-style text_projection): no submodule to pin.
  return {"Run the code in the model's own forward() that uses " + layer.name +
              " in FP32: autocast off around it, its fp16 inputs cast to float32 (no submodule holds it, so there is "
              "none to pin; or move that code into a module to have it named).",
          "# in the model's forward(), around the code that uses self." + layer.name + ":\n"
          "with torch.autocast(device_type=\"" + device_type(run) + "\", enabled=False):\n"
          "    ...  # that code, with its fp16 tensors .float()",
          "", ""};
}

}  // namespace ampdiag::analyzer::suggest
