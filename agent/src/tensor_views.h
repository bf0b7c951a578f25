// From at::Tensor to what the kernels read, without a copy when the tensor allows it.
#pragma once

#include <ATen/core/Tensor.h>

#include "ampdiag/kernels/tensor_stats.h"

namespace ampdiag::agent {

// A CPU tensor of float32/float16/bfloat16 whose elements fill one gap-free block (in any
// order), which the kernels can read (and unscale) in place.
bool directly_readable(const at::Tensor& t);

// A view of t for the statistics kernels. When t is not directly readable (a CUDA tensor,
// float64, a non-contiguous layout) `copy` receives a contiguous CPU copy (float64 and
// other floating types as float32) and the view points into it.
kernels::TensorRef stats_view(const at::Tensor& t, at::Tensor& copy);

}  // namespace ampdiag::agent
