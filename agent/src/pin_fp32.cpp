// pin_fp32.h: autocast off, fp32 inputs.
#include "ampdiag/pin_fp32.h"

#include <stdexcept>

#include "autocast_state.h"

namespace ampdiag {

AutocastDisabled::AutocastDisabled()
    : cpu_(agent::autocast_enabled(at::kCPU)), cuda_(agent::autocast_enabled(at::kCUDA)) {
  agent::set_autocast_enabled(at::kCPU, false);
  agent::set_autocast_enabled(at::kCUDA, false);
}

AutocastDisabled::~AutocastDisabled() {
  agent::set_autocast_enabled(at::kCPU, cpu_);
  agent::set_autocast_enabled(at::kCUDA, cuda_);
}

at::Tensor to_fp32(const at::Tensor& t) {
  if (t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat) return t.to(at::kFloat);
  return t;
}

Fp32Pins::Fp32Pins(std::vector<std::string> module_paths) {
  for (auto& p : module_paths) {
    if (p.empty()) throw std::invalid_argument("Fp32Pins: an empty module path cannot be pinned");
    paths_.insert(std::move(p));
  }
}

}  // namespace ampdiag
