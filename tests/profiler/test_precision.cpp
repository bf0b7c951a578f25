// kernel_kind(): the precision of a kernel from the names cuBLAS, CUTLASS and ATen give.
#include <catch2/catch.hpp>

#include "ampdiag/profiler/precision.h"

using ampdiag::profiler::kernel_kind;
using ampdiag::profiler::kind_of_dtype;
using ampdiag::rundb::GpuKind;

TEST_CASE("cuBLAS and CUTLASS half GEMMs are fp16", "[profiler][precision]") {
  CHECK(kernel_kind("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn") == GpuKind::kFloat16);
  CHECK(kernel_kind("sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x32_stage4") == GpuKind::kFloat16);
  CHECK(kernel_kind("volta_h884gemm_64x64_ldg8_nn") == GpuKind::kFloat16);
}

TEST_CASE("bf16 names are bf16 although they contain f16", "[profiler][precision]") {
  CHECK(kernel_kind("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8") == GpuKind::kBFloat16);
  CHECK(kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>") ==
        GpuKind::kBFloat16);
}

TEST_CASE("ATen kernels on c10::Half are fp16 even where they accumulate in float", "[profiler][precision]") {
  CHECK(kernel_kind("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::Half, "
                    "at::native::func_wrapper_t<float, at::native::sum_functor>>>") == GpuKind::kFloat16);
}

TEST_CASE("sgemm and float kernels are fp32", "[profiler][precision]") {
  CHECK(kernel_kind("ampere_sgemm_128x64_tn") == GpuKind::kFloat32);
  CHECK(kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") ==
        GpuKind::kFloat32);
  CHECK(kernel_kind("sm80_xmma_gemm_tf32f32_tf32f32_f32_nn_n_tilesize64x64x32") == GpuKind::kFloat32);
}

TEST_CASE("a name that names no type takes the launching module's dtype", "[profiler][precision]") {
  CHECK(kernel_kind("cudnn::bn_fw_tr_1C11_kernel_NCHW", GpuKind::kFloat16) == GpuKind::kFloat16);
  CHECK(kernel_kind("cudnn::bn_fw_tr_1C11_kernel_NCHW") == GpuKind::kOtherKernel);
  CHECK(kind_of_dtype("bfloat16") == GpuKind::kBFloat16);
  CHECK(kind_of_dtype("torch.float16") == GpuKind::kFloat16);
  CHECK(kind_of_dtype("int64") == GpuKind::kOtherKernel);
}
