// Gradient-statistics throughput on a CUDA device: the ViT-B gradient set of
// kernels_bench.cpp, on the GPU, against baselines measured in the same run:
//   (a) torch's sum over one contiguous buffer of the same bytes (the device's read bandwidth
//       as a well-tuned reduction reaches it),
//   (e) torch's own unscale, `_amp_foreach_non_finite_check_and_unscale_`, which the fused
//       unscale replaces,
//   (d) the per-tensor loop users write today (`abs().max()`, `isinf().any()`,
//       `isnan().any()`, each `.item()`).
// Each pass is timed on the host from a synchronised device to its results on the host (for
// the engine: its ticket is ready, the pinned copy has landed). Prints a Markdown table.
// Without a CUDA device it says so and exits 77.
//
//   ampdiag_cuda_kernels_bench [--reps R]
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ampdiag/kernels/cuda_stats.h"
#include "vit_gradients.h"

using namespace ampdiag;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds from a synchronised device to f's return (f waits for its own results).
template <class F>
double seconds(F&& f) {
  torch::cuda::synchronize();
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int parse_reps(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
      if (reps < 1 || reps > 10000) {
        std::fprintf(stderr, "ampdiag_cuda_kernels_bench: --reps must be between 1 and 10000\n");
        std::exit(2);
      }
    } else {
      std::fprintf(stderr, "usage: ampdiag_cuda_kernels_bench [--reps R]\n");
      std::exit(2);
    }
  }
  return reps;
}

// One engine pass, from launch to its results on the host.
void engine_pass(kernels::CudaStatsEngine& engine, const std::vector<kernels::TensorRef>& refs,
                 const kernels::CudaLaunch& launch) {
  kernels::CudaTicket* ticket = engine.launch(refs.data(), refs.size(), launch);
  if (!ticket) {
    std::fprintf(stderr, "ampdiag_cuda_kernels_bench: every slot is held\n");
    std::exit(1);
  }
  ticket->wait();
  ticket->release();
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = parse_reps(argc, argv);
  if (!kernels::cuda_device_available()) {
    std::printf("skipped: no CUDA device (%s)\n", kernels::cuda_unavailable_reason().c_str());
    return 77;
  }
  const float scale = 65536.0f;
  const auto host = bench::make_vit_b_gradients(scale, 1);
  const std::int64_t total = bench::total_elements(host);
  const double gb = double(total) * 4 / 1e9;

  const auto cuda = at::TensorOptions().device(at::kCUDA, 0).dtype(at::kFloat);
  std::vector<at::Tensor> grads;
  std::vector<kernels::TensorRef> refs;
  for (const auto& t : host) {
    grads.push_back(at::from_blob(const_cast<float*>(t.values.data()), {std::int64_t(t.values.size())}, at::kFloat).to(cuda));
    refs.push_back({grads.back().data_ptr(), grads.back().numel(), kernels::DType::kFloat32});
  }
  const at::Tensor flat = at::randn({total}, cuda);
  at::Tensor found_inf = at::zeros({1}, cuda);
  at::Tensor inv_scale = at::full({1}, 1.0f / scale, cuda);
  at::Tensor undo_scale = at::full({1}, scale, cuda);

  kernels::CudaStatsEngine engine;
  kernels::CudaLaunch stats_launch;
  stats_launch.stream = c10::cuda::getCurrentCUDAStream().stream();
  kernels::CudaLaunch hist_launch = stats_launch;
  hist_launch.histogram = true;
  kernels::CudaLaunch unscale_launch = stats_launch;
  unscale_launch.found_inf = found_inf.data_ptr<float>();

  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("## Gradient statistics on CUDA: ViT-B gradient set (%zu fp32 tensors, %.1f M elements, %.0f MB)\n\n",
              grads.size(), double(total) / 1e6, gb * 1e3);
  std::printf("Device: %s (%d SMs); torch %s. Medians of %d interleaved runs, each from a synchronised device to "
              "the results on the host.\n\n", prop.name, prop.multiProcessorCount, TORCH_VERSION, reps);

  std::vector<double> ta, tb, th, tc, te, td;
  volatile float sink = 0;
  for (int r = 0; r < reps + 2; ++r) {  // the first two rounds size the slots and warm the caches
    const double a = seconds([&] { sink = sink + at::sum(flat).item<float>(); });
    const double b = seconds([&] { engine_pass(engine, refs, stats_launch); });
    const double h = seconds([&] { engine_pass(engine, refs, hist_launch); });
    // Alternate the scale so repeated unscales return to the same values.
    unscale_launch.inv_scale = (r % 2 == 0 ? inv_scale : undo_scale).data_ptr<float>();
    const double c = seconds([&] { engine_pass(engine, refs, unscale_launch); });
    const double e = seconds([&] {
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, r % 2 == 0 ? undo_scale : inv_scale);
      torch::cuda::synchronize();
    });
    const double d = seconds([&] {
      for (const auto& g : grads) {
        sink = sink + g.abs().max().item<float>();
        sink = sink + float(at::isinf(g).any().item<bool>());
        sink = sink + float(at::isnan(g).any().item<bool>());
      }
    });
    if (r < 2) continue;
    ta.push_back(a);
    tb.push_back(b);
    th.push_back(h);
    tc.push_back(c);
    te.push_back(e);
    td.push_back(d);
  }
  if (found_inf.item<float>() != 0.0f) {
    std::fprintf(stderr, "ampdiag_cuda_kernels_bench: found_inf was set on finite gradients\n");
    return 1;
  }
  const auto row = [&](const char* what, const std::vector<double>& t) {
    const double s = median(t);
    std::printf("| %s | %.3f | %.0f | %.2f |\n", what, s * 1e3, gb / s, median(ta) / s);
  };
  std::printf("| pass | median ms | GB/s (bytes once) | speed against (a) |\n|---|---:|---:|---:|\n");
  row("(a) torch sum over the same bytes, one buffer", ta);
  row("(b) ampdiag statistics", tb);
  row("(b') ampdiag statistics + exponent histograms", th);
  row("(c) ampdiag fused unscale + statistics", tc);
  row("(e) torch's unscale (`_amp_foreach_non_finite_check_and_unscale_`)", te);
  row("(d) per-tensor loop: abs().max(), isinf/isnan().any(), .item()", td);
  std::printf("\n(b)/(a) = %.2f; (c) against (e), torch's unscale alone: %.2f x its time; (d)/(b) = %.0f x\n",
              median(ta) / median(tb), median(tc) / median(te), median(td) / median(tb));
  return 0;
}
