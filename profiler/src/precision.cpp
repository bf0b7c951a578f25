// kernel_kind(); see precision.h.
#include "ampdiag/profiler/precision.h"

#include <cctype>
#include <string>

namespace ampdiag::profiler {

namespace {

bool contains_any(const std::string& s, std::initializer_list<const char*> needles) {
  for (const char* n : needles)
    if (s.find(n) != std::string::npos) return true;
  return false;
}

}  // namespace

rundb::GpuKind kernel_kind(std::string_view name, rundb::GpuKind hint) {
  std::string s(name);
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  // ATen's templates name c10::BFloat16 / c10::Half (mangled: 8BFloat16, 4Half); cuBLAS,
  // cuDNN and CUTLASS kernels say bf16 / fp16 / f16 / h884-style tile names.
  if (contains_any(s, {"bf16", "bfloat16"})) return rundb::GpuKind::kBFloat16;
  if (contains_any(s, {"fp16", "f16", "half", "hgemm", "h884", "h1688", "h16816"})) return rundb::GpuKind::kFloat16;
  if (contains_any(s, {"sgemm", "tf32", "fp32", "f32", "float"}))
    return rundb::GpuKind::kFloat32;
  return hint;
}

rundb::GpuKind kind_of_dtype(std::string_view dtype) {
  if (dtype == "float16" || dtype == "torch.float16" || dtype == "half") return rundb::GpuKind::kFloat16;
  if (dtype == "bfloat16" || dtype == "torch.bfloat16") return rundb::GpuKind::kBFloat16;
  if (dtype == "float32" || dtype == "torch.float32" || dtype == "float") return rundb::GpuKind::kFloat32;
  return rundb::GpuKind::kOtherKernel;
}

}  // namespace ampdiag::profiler
