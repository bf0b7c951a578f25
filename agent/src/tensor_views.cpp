// tensor_views.h: dtype mapping and the copy fallback.
#include "tensor_views.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace ampdiag::agent {

namespace {

bool kernel_dtype(at::ScalarType t, kernels::DType& out) {
  switch (t) {
    case at::kFloat: out = kernels::DType::kFloat32; return true;
    case at::kHalf: out = kernels::DType::kFloat16; return true;
    case at::kBFloat16: out = kernels::DType::kBFloat16; return true;
    default: return false;
  }
}

}  // namespace

// Whether t's elements fill one gap-free block in any order (contiguous, or a permutation
// such as a transpose). Every statistic is independent of element order, and the unscale
// is elementwise, so such a block is read (and rewritten) in place.
bool dense(const at::Tensor& t) {
  if (t.is_contiguous()) return true;
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size)
  for (std::int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) dims.push_back({t.stride(d), t.size(d)});
  std::sort(dims.begin(), dims.end());
  std::int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

bool directly_readable(const at::Tensor& t) {
  kernels::DType d;
  return t.device().is_cpu() && t.layout() == at::kStrided && kernel_dtype(t.scalar_type(), d) && dense(t);
}

kernels::TensorRef stats_view(const at::Tensor& t, at::Tensor& copy) {
  kernels::DType d = kernels::DType::kFloat32;
  if (directly_readable(t)) {
    kernel_dtype(t.scalar_type(), d);
    return {t.data_ptr(), t.numel(), d};
  }
  copy = t.detach().to(at::kCPU);
  if (!kernel_dtype(copy.scalar_type(), d)) copy = copy.to(at::kFloat);
  copy = copy.contiguous();
  kernel_dtype(copy.scalar_type(), d);
  return {copy.data_ptr(), copy.numel(), d};
}

}  // namespace ampdiag::agent
