// suggestions.h: the snippets a user pastes to apply a fix.
#include "suggestions.h"

#include <cctype>
#include <cmath>

namespace ampdiag::analyzer::suggest {

namespace {

std::string device_type(const Run& run) {
  const std::string device = run.meta_or("device", "cuda");
  return device.rfind("cuda", 0) == 0 ? "cuda" : "cpu";
}

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
    out += all_digits(part) ? "[" + part + "]" : "." + part;
    if (dot == std::string::npos) break;
    begin = dot + 1;
  }
  return out;
}

Suggestion pin_fp32(const Run& run, const std::string& module_path) {
  Suggestion s;
  s.summary = "Run " + module_path + " in FP32: autocast off around it, its inputs cast to float.";
  const std::string attr = python_attribute(module_path);
  s.python = "# where the model calls " + module_path + " in forward():\n"
             "with torch.autocast(device_type=\"" + device_type(run) + "\", enabled=False):\n"
             "    out = " + attr + "(x.float())\n"
             "# or, with ampdiag: ampdiag.pin_fp32(" + attr + ")";
  s.cpp = "// ampdiag/pin_fp32.h\n"
          "ampdiag::Fp32Pins pins({\"" + module_path + "\"});\n"
          "out = pins.run(\"" + module_path + "\", [&](const at::Tensor& in) { return module(in); }, x);";
  return s;
}

Suggestion use_bf16(const Run& run) {
  Suggestion s;
  s.summary = "Or train in bfloat16 (fp32's range, no loss scaler needed) if the hardware supports it.";
  s.python = "with torch.autocast(device_type=\"" + device_type(run) + "\", dtype=torch.bfloat16):\n"
             "    loss = model(x)\n"
             "loss.backward()  # no GradScaler with bf16";
  s.cpp = "at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);  // at::kCUDA on GPUs\n"
          "at::autocast::set_autocast_enabled(at::kCPU, true);";
  return s;
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

std::string module_for_layer(const Run& run, const rundb::LayerRow& layer) {
  std::string best;
  for (const auto& m : run.modules) {
    const std::string& p = m.info.path;
    if (p.size() > best.size() && layer.name.size() > p.size() && layer.name.compare(0, p.size(), p) == 0 &&
        layer.name[p.size()] == '.')
      best = p;
  }
  return best.empty() ? layer.module_path : best;
}

std::string common_module(const std::string& a, const std::string& b) {
  std::size_t end = 0;  // length of the common prefix made of whole components
  for (std::size_t i = 0;; ++i) {
    const bool a_end = i == a.size() || a[i] == '.', b_end = i == b.size() || b[i] == '.';
    if (a_end && b_end) end = i;
    if (i == a.size() || i == b.size() || a[i] != b[i]) break;
  }
  return a.substr(0, end);
}

}  // namespace ampdiag::analyzer::suggest
