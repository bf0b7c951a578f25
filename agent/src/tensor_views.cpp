// tensor_views.h: dtype mapping and the copy fallback.
#include "tensor_views.h"

#include <ATen/ATen.h>

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

bool directly_readable(const at::Tensor& t) {
  kernels::DType d;
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && kernel_dtype(t.scalar_type(), d);
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
