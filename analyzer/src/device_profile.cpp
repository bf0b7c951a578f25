// device_profile() and pin_cost(); see device_profile.h.
#include "device_profile.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "suggestions.h"

namespace ampdiag::analyzer {

namespace {

constexpr std::size_t kListedModules = 8;
constexpr const char* kOutside = "(outside every module)";

using rundb::GpuKind;

std::string us_text(double us) {
  char b[32];
  std::snprintf(b, sizeof b, us >= 100 ? "%.0f" : "%.3g", us);
  return b;
}

std::string factor_text(double k) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2g", k);
  return b;
}

const std::string* module_path(const Run& run, std::int64_t id) {
  return id >= 0 && std::size_t(id) < run.modules.size() ? &run.modules[std::size_t(id)].info.path : nullptr;
}

// fp32 time per fp32 kernel over half time per half kernel, over the modules of `type`
// that ran kernels of both kinds (pinned ones, say); 0 when there are none.
double measured_factor(const Run& run, const std::string& type) {
  std::int64_t fp32_ns = 0, fp32_n = 0, half_ns = 0, half_n = 0;
  for (const auto& [id, t] : run.gpu.modules) {
    if (id < 0 || std::size_t(id) >= run.modules.size() || run.modules[std::size_t(id)].info.module_type != type) continue;
    fp32_ns += t.ns[int(GpuKind::kFloat32)];
    fp32_n += t.count[int(GpuKind::kFloat32)];
    half_ns += t.half_ns();
    half_n += t.count[int(GpuKind::kFloat16)] + t.count[int(GpuKind::kBFloat16)];
  }
  if (fp32_n == 0 || half_n == 0 || half_ns == 0) return 0.0;
  return (double(fp32_ns) / double(fp32_n)) / (double(half_ns) / double(half_n));
}

}  // namespace

DeviceProfile device_profile(const Run& run) {
  DeviceProfile p;
  p.status = run.meta_or("profiler", "");
  if (p.status == "unavailable") {
    for (const auto& e : run.events)
      if (e.kind == "profiler-unavailable") p.unavailable = e.detail;
    return p;
  }
  p.steps = run.gpu.steps;
  if (p.steps == 0) return p;
  const double steps = double(p.steps);
  p.step_us = double(run.gpu.total_ns) / steps / 1e3;
  p.ampdiag_us = double(run.gpu.phase_ns[int(rundb::GpuPhase::kAmpdiag)]) / steps / 1e3;
  for (const auto& [id, t] : run.gpu.modules) {
    const double kernel_ns = double(t.kernel_ns());
    ModuleDeviceTime m;
    const std::string* path = module_path(run, id);
    m.module = path ? *path : kOutside;
    m.us_per_step = (kernel_ns + double(t.ns[int(GpuKind::kMemcpy)])) / steps / 1e3;
    if (kernel_ns > 0) {
      m.fp32 = double(t.ns[int(GpuKind::kFloat32)]) / kernel_ns;
      m.fp16 = double(t.ns[int(GpuKind::kFloat16)]) / kernel_ns;
      m.bf16 = double(t.ns[int(GpuKind::kBFloat16)]) / kernel_ns;
      m.other = double(t.ns[int(GpuKind::kOtherKernel)]) / kernel_ns;
    }
    p.modules.push_back(std::move(m));
  }
  std::stable_sort(p.modules.begin(), p.modules.end(),
                   [](const ModuleDeviceTime& a, const ModuleDeviceTime& b) { return a.us_per_step > b.us_per_step; });
  if (p.modules.size() > kListedModules) p.modules.resize(kListedModules);
  return p;
}

std::string pin_cost(const Run& run, const std::string& module) {
  if (run.gpu.steps == 0) return "";
  // Half-precision time by module type, over the module and everything inside it: each
  // type's kernels slow down by that type's factor.
  std::map<std::string, std::int64_t> half_by_type;
  std::int64_t half = 0, fp32 = 0;
  for (const auto& [id, t] : run.gpu.modules) {
    const std::string* path = module_path(run, id);
    if (!path || !suggest::within(*path, module)) continue;
    half += t.half_ns();
    fp32 += t.ns[int(GpuKind::kFloat32)];
    if (t.half_ns() > 0) half_by_type[run.modules[std::size_t(id)].info.module_type] += t.half_ns();
  }
  if (half == 0 && fp32 == 0) return "";
  const double steps = double(run.gpu.steps);
  const std::string precision = run.fp16() ? "fp16" : "bf16";
  if (half == 0)
    return "none: " + module + " already runs its kernels in FP32 (" + us_text(double(fp32) / steps / 1e3) +
           " us/step)";
  double expected = 0;
  std::string measured, assumed;
  std::string incomparable;
  for (const auto& [type, ns] : half_by_type) {
    double k = measured_factor(run, type);
    const std::string name = type.empty() ? std::string("untyped") : type;
    if (k > 0 && k < 1) {
      // FP32 kernels faster per kernel than the half ones: smaller work, not comparable.
      incomparable += (incomparable.empty() ? "" : ", ") + name;
      k = 0;
    }
    expected += double(ns) * (k > 0 ? k : kAssumedFp32Factor);
    if (k > 0)
      measured += (measured.empty() ? "" : ", ") + name + " " + factor_text(k) + "x";
    else
      assumed += (assumed.empty() ? "" : ", ") + name;
  }
  const double k = expected / double(half);
  const double half_us = double(half) / steps / 1e3;
  std::string why;
  if (!measured.empty())
    why = "measured: fp32 over " + precision + " time per kernel of the same module type in this run: " + measured;
  if (!assumed.empty())
    why += (why.empty() ? "" : "; ") + std::string("assumed ") + factor_text(kAssumedFp32Factor) + "x for " + assumed +
           ", which ran no comparable fp32 kernels in this run" +
           (incomparable.empty() ? std::string()
                                 : " (" + incomparable + "'s fp32 kernels were faster per kernel than its " + precision +
                                       " ones: smaller work)") +
           ": memory-bound kernels move twice the bytes in FP32, tensor-core GEMMs can be several times slower";
  return module + " spends " + us_text(half_us) + " us/step in " + precision +
         " kernels; in FP32 expect about " + factor_text(k) + "x that (+" + us_text(half_us * (k - 1)) + " us/step; " + why +
         ")";
}

}  // namespace ampdiag::analyzer
