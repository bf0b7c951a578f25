#include "batch_looks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/isinf.h>
#include <ATen/ops/isnan.h>

#include <cstdint>
#include <limits>

#include "agent_setup.h"

namespace ampdiag::agent {

namespace {

// "x (Float [8, 16]): 1 NaN of 128 values", as the Python agent words an input: t's NaN,
// or with `inf` its Inf ("2 -Inf of 128 values"); empty where t holds none.
std::string nonfinite_input(const std::string& name, const at::Tensor& t, bool inf) {
  std::string counts;
  if (!inf) {
    if (const std::int64_t nan = at::isnan(t).sum().item<std::int64_t>(); nan > 0) counts = std::to_string(nan) + " NaN";
  } else if (const std::int64_t count = at::isinf(t).sum().item<std::int64_t>(); count > 0) {
    const std::int64_t positive = t.eq(std::numeric_limits<double>::infinity()).sum().item<std::int64_t>();
    if (positive > 0) counts = std::to_string(positive) + " +Inf";
    if (count > positive) counts += (counts.empty() ? "" : " and ") + std::to_string(count - positive) + " -Inf";
  }
  if (counts.empty()) return "";
  return name + " (" + dtype_name(t.scalar_type()) + " " + c10::str(t.sizes()) + "): " + counts + " of " +
         std::to_string(t.numel()) + " values";
}

}  // namespace

// Host inputs only: a device count would wait for the device, and a device probe's NaN is
// known a step late anyway.
bool BatchLooks::nonfinite(const at::Tensor* module_input) {
  std::string found;
  for (const auto& [name, t] : inputs_) {
    if (!t.device().is_cpu() || t.layout() != at::kStrided) continue;  // (a sparse tensor's values are not read)
    found = nonfinite_input(name, t, /*inf=*/false);
    if (!found.empty()) break;
  }
  if (found.empty() && module_input && module_input->device().is_cpu() && module_input->is_floating_point() &&
      at::isinf(*module_input).any().item<bool>()) {
    const Named* given = viewed_by(*module_input);
    if (given && given->second.device().is_cpu()) found = nonfinite_input(given->first, given->second, /*inf=*/true);
  }
  if (!found.empty()) session_.event("input-nan", found);
  looked_.insert(looked_.end(), inputs_.begin(), inputs_.end());  // once a step
  inputs_.clear();
  return !found.empty();
}

const BatchLooks::Named* BatchLooks::viewed_by(const at::Tensor& x) const {
  if (!x.has_storage() || x.storage().nbytes() == 0) return nullptr;
  const void* memory = x.storage().data();
  for (const auto* list : {&inputs_, &looked_})
    for (const auto& given : *list)
      if (given.second.has_storage() && given.second.storage().data() == memory) return &given;
  return nullptr;
}

}  // namespace ampdiag::agent
