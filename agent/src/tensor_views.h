// From at::Tensor to what the session core reads, without a copy when the tensor allows
// it, and never through the host for a device tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include "device_engine.h"

namespace ampdiag::agent {

// float16 or bfloat16: what autocast computes in, and what a precision check compares.
inline bool half_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Whether `x` is `of`, unchanged or a view of it: a module given it receives what `of`'s maker
// made.
inline bool is_or_views(const at::Tensor& x, const at::Tensor& of) {
  return x.is_same(of) || (x.is_view() && x._base().is_same(of));
}

// The session's device for a tensor's device; false for a device no engine reads.
bool session_device(const at::Device& d, Device& out);

// The stream work on `d` is enqueued on now: torch's current stream for the device, through
// c10's device-agnostic interface (registered by libc10_cuda when CUDA torch is loaded).
void* current_stream(const at::Device& d);

// A float32/float16/bfloat16 tensor on the CPU or CUDA whose elements fill one gap-free
// block (in any order): the engines read (and unscale) it in place.
bool directly_readable(const at::Tensor& t);

// What the engines read for t. When t is not directly readable (float64, a non-dense
// layout) `copy` receives a dense float copy on t's own device and the view points into
// it; a device tensor's copy is made on its current stream, which also runs the engine.
// False for a tensor on a device no engine reads.
bool stats_view(const at::Tensor& t, at::Tensor& copy, DeviceTensor& out);

}  // namespace ampdiag::agent
