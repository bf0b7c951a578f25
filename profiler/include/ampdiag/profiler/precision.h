// Which precision a kernel computes in, from its name (cuBLAS, cuDNN, CUTLASS and ATen
// name their kernels by their types), else from what the launching module computes in.
#pragma once

#include <string_view>

#include "ampdiag/rundb/rows.h"

namespace ampdiag::profiler {

// bf16 before fp16 ("bf16" holds "f16"), fp16 before fp32 (half kernels often accumulate
// in float and say so). `hint` (the launching range's dtype, kOtherKernel when none) for
// names that name no type.
rundb::GpuKind kernel_kind(std::string_view name, rundb::GpuKind hint = rundb::GpuKind::kOtherKernel);

// "float16" / "bfloat16" / "float32" (a torch dtype's name) to a kind; kOtherKernel else.
rundb::GpuKind kind_of_dtype(std::string_view dtype);

}  // namespace ampdiag::profiler
