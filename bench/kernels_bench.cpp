// Gradient-statistics throughput on a ViT-B gradient set, against two baselines measured
// in the same run: (a) a plain sum over the same bytes (the machine's read bandwidth) and
// (d) the per-tensor loop users write today through LibTorch; then the fused unscale of a
// small model's gradients in cache against (e) torch's own unscale. Prints Markdown tables.
//
//   ampdiag_kernels_bench [--threads N[,N...]] [--reps R]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ampdiag/kernels/cpu_stats.h"
#include "vit_gradients.h"

using namespace ampdiag;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::vector<int> threads;
  int reps = 9;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "ampdiag_kernels_bench: %s\nusage: ampdiag_kernels_bench [--threads N[,N...]] [--reps R]\n", why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--threads" || a == "--reps") && i + 1 >= argc) usage(("missing value after " + a).c_str());
    if (a == "--threads") {
      std::stringstream list(argv[++i]);
      for (std::string item; std::getline(list, item, ',');) {
        const int n = std::atoi(item.c_str());
        if (n < 1 || n > 1024) usage(("--threads: not a thread count: " + item).c_str());
        args.threads.push_back(n);
      }
    } else if (a == "--reps") {
      args.reps = std::atoi(argv[++i]);
      if (args.reps < 1 || args.reps > 1000) usage("--reps must be between 1 and 1000");
    } else {
      usage(("unknown argument: " + a).c_str());
    }
  }
  if (args.threads.empty()) {
    args.threads.push_back(1);
    const int all = int(std::max(1u, std::thread::hardware_concurrency()));
    if (all > 1) args.threads.push_back(all);
  }
  return args;
}

// The baseline read: 8 independent float accumulators (a vector register's worth).
__attribute__((target("avx2"))) float plain_sum(const float* p, std::size_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += p[i + l];
  for (; i < n; ++i) acc[0] += p[i];
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

// Splits the tensors' bytes evenly over `threads` threads (by element ranges).
float plain_read(const std::vector<bench::GradientTensor>& tensors, int threads, std::int64_t total) {
  std::vector<float> sums(std::size_t(threads), 0.0f);
  auto work = [&](int t) {
    const std::int64_t begin = total * t / threads, end = total * (t + 1) / threads;
    std::int64_t offset = 0;
    for (const auto& g : tensors) {
      const std::int64_t n = std::int64_t(g.values.size());
      const std::int64_t lo = std::max(begin, offset), hi = std::min(end, offset + n);
      if (lo < hi) sums[std::size_t(t)] += plain_sum(g.values.data() + (lo - offset), std::size_t(hi - lo));
      offset += n;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  float s = 0;
  for (float v : sums) s += v;
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string cpu_model() {
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

template <class F>
double seconds(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The gradient set of python_attach_bench.py's MLP (256-512-512-512-1): 657 k fp32
// values, in cache between steps, where the agent's fused pass replaces torch's unscale.
// Against torch._amp_foreach_non_finite_check_and_unscale_ on the same tensors, both on
// torch's intra-op team as the agents run it (CpuEngineOptions::parallel_for).
void mlp_unscale_table(const Args& args, float scale) {
  const std::vector<std::vector<std::int64_t>> shapes = {{512, 256}, {512}, {512, 512}, {512},
                                                         {512, 512}, {512}, {1, 512}, {1}};
  std::vector<at::Tensor> grads;
  std::vector<kernels::MutableTensorRef> refs;
  std::int64_t total = 0;
  for (const auto& shape : shapes) {
    grads.push_back(at::randn(shape).mul_(scale * 1e-3f));
    refs.push_back({grads.back().data_ptr(), grads.back().numel(), kernels::DType::kFloat32});
    total += grads.back().numel();
  }
  std::vector<kernels::TensorStats> stats(grads.size());
  std::printf("\n## Fused unscale in cache: the attach benchmark MLP's gradients (%zu fp32 tensors, %.0f k elements)\n\n",
              grads.size(), double(total) / 1e3);
  std::printf("| threads | (c) unscale+stats µs | (e) torch's unscale µs | (c)/(e) |\n|---:|---:|---:|---:|\n");
  for (int threads : args.threads) {
    at::set_num_threads(threads);
    kernels::CpuEngineOptions options;
    options.parallel_for = [](std::int64_t count, const std::function<void(std::int64_t)>& task) {
      at::parallel_for(0, count, 1, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) task(i);
      });
    };
    kernels::CpuStatsEngine engine(options);
    at::Tensor found_inf = at::zeros({1}), inv = at::empty({1});
    std::vector<double> tc, te;
    const int calls = 100 * args.reps;  // each a few tens of µs: many, for a stable median
    for (int r = 0; r < calls + 10; ++r) {
      const float factor = (r % 2 == 0) ? 1.0f / scale : scale;  // back to the same values
      inv.fill_(factor);
      const double c = seconds([&] { engine.unscale_and_compute(refs.data(), refs.size(), factor, stats.data()); });
      const double e = seconds([&] { at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv); });
      if (r < 10) continue;
      tc.push_back(c);
      te.push_back(e);
    }
    const double c = median(tc) * 1e6, e = median(te) * 1e6;
    std::printf("| %d | %.1f | %.1f | %.2f |\n", threads, c, e, c / e);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const float scale = 65536.0f;
  auto tensors = bench::make_vit_b_gradients(scale, 1);
  const std::int64_t total = bench::total_elements(tensors);
  const double gb = double(total) * 4 / 1e9;

  std::vector<kernels::TensorRef> refs;
  std::vector<kernels::MutableTensorRef> mutable_refs;
  std::vector<at::Tensor> torch_views;
  for (auto& t : tensors) {
    refs.push_back({t.values.data(), std::int64_t(t.values.size()), kernels::DType::kFloat32});
    mutable_refs.push_back({t.values.data(), std::int64_t(t.values.size()), kernels::DType::kFloat32});
    torch_views.push_back(at::from_blob(t.values.data(), {std::int64_t(t.values.size())}, at::kFloat));
  }
  std::vector<kernels::TensorStats> stats(tensors.size());

  std::printf("## Gradient statistics: ViT-B gradient set (%zu fp32 tensors, %.1f M elements, %.0f MB)\n\n",
              tensors.size(), double(total) / 1e6, gb * 1e3);
  std::printf("Machine: %s, %u hardware threads; kernels ISA: %s; torch %s. Medians of %d interleaved runs.\n\n",
              cpu_model().c_str(), std::thread::hardware_concurrency(), kernels::cpu_isa_name(kernels::best_cpu_isa()),
              TORCH_VERSION, args.reps);
  std::printf("| threads | (a) plain read GB/s | (b) stats GB/s | (c) unscale+stats GB/s | (d) naive torch loop GB/s | (b)/(a) | (c)/(a) | (b)/(d) |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  volatile float sink = 0;
  for (int threads : args.threads) {
    kernels::CpuEngineOptions options;
    options.threads = threads;
    kernels::CpuStatsEngine engine(options);
    at::set_num_threads(threads);
    std::vector<double> ta, tb, tc, td;
    for (int r = 0; r < args.reps + 1; ++r) {  // the first round warms caches, pages and pools
      const double a = seconds([&] { sink = sink + plain_read(tensors, threads, total); });
      const double b = seconds([&] { engine.compute(refs.data(), refs.size(), stats.data()); });
      // Alternate the scale so repeated unscales return to the same values.
      const float inv = (r % 2 == 0) ? 1.0f / scale : scale;
      const double c = seconds([&] { engine.unscale_and_compute(mutable_refs.data(), mutable_refs.size(), inv, stats.data()); });
      const double d = seconds([&] {
        for (const auto& g : torch_views) {
          sink = sink + g.abs().max().item<float>();
          sink = sink + float(at::isinf(g).any().item<bool>());
          sink = sink + float(at::isnan(g).any().item<bool>());
        }
      });
      if (r == 0) continue;
      ta.push_back(a);
      tb.push_back(b);
      tc.push_back(c);
      td.push_back(d);
    }
    const double a = gb / median(ta), b = gb / median(tb), c = gb / median(tc), d = gb / median(td);
    std::printf("| %d | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %.1f |\n", threads, a, b, c, d, b / a, c / a, b / d);
    std::fflush(stdout);
  }
  mlp_unscale_table(args, scale);
  return 0;
}
