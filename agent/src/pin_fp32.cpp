// pin_fp32.h: autocast off, fp32 inputs.
#include "ampdiag/pin_fp32.h"

#include <ATen/autocast_mode.h>

#include <stdexcept>

namespace ampdiag {

AutocastDisabled::AutocastDisabled()
    : cpu_(at::autocast::is_autocast_enabled(at::kCPU)), cuda_(at::autocast::is_autocast_enabled(at::kCUDA)) {
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::set_autocast_enabled(at::kCUDA, false);
}

AutocastDisabled::~AutocastDisabled() {
  at::autocast::set_autocast_enabled(at::kCPU, cpu_);
  at::autocast::set_autocast_enabled(at::kCUDA, cuda_);
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
