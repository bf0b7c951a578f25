// tensor_views.h: dtype and device mapping, and the same-device copy fallback.
#include "tensor_views.h"

#include <ATen/core/Tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

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

}  // namespace

void* current_stream(const at::Device& d) {
  const auto* impl = c10::impl::getDeviceGuardImpl(d.type());
  return impl->getStream(d).native_handle();
}

bool session_device(const at::Device& d, Device& out) {
  if (d.is_cpu()) {
    out = {DeviceType::kCpu, 0};
    return true;
  }
  if (d.is_cuda()) {
    out = {DeviceType::kCuda, d.has_index() ? int(d.index()) : 0};
    return true;
  }
  return false;
}

bool directly_readable(const at::Tensor& t) {
  kernels::DType d;
  Device where;
  return session_device(t.device(), where) && t.layout() == at::kStrided && kernel_dtype(t.scalar_type(), d) &&
         dense(t);
}

bool stats_view(const at::Tensor& t, at::Tensor& copy, DeviceTensor& out) {
  if (!session_device(t.device(), out.device) || t.layout() != at::kStrided) return false;
  const at::Tensor* src = &t;
  kernels::DType d = kernels::DType::kFloat32;
  if (!directly_readable(t)) {
    copy = t.detach();
    if (!kernel_dtype(copy.scalar_type(), d)) copy = copy.to(at::kFloat);
    copy = copy.contiguous();
    src = &copy;
  }
  kernel_dtype(src->scalar_type(), d);
  out.ref = {src->data_ptr(), src->numel(), d};
  out.stream = out.device.type == DeviceType::kCpu ? nullptr : current_stream(t.device());
  return true;
}

}  // namespace ampdiag::agent
