// The CPU gradient-statistics engine: one multi-threaded, vectorized pass over many
// tensors, optionally fused with the loss-scaler's unscale.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "ampdiag/kernels/tensor_stats.h"

namespace ampdiag::kernels {

// Instruction sets the CPU kernels are compiled for; the best one the CPU runs is
// picked at run time (GCC's -march=native would tie the binary to the build machine).
enum class CpuIsa : std::uint8_t { kAuto = 0, kBaseline, kAvx2, kAvx512 };

const char* cpu_isa_name(CpuIsa isa);
bool cpu_isa_supported(CpuIsa isa);  // kAuto and kBaseline are always supported
CpuIsa best_cpu_isa();

// Runs task(i) for every i in [0, count) in parallel; returns when all are done.
using ParallelFor = std::function<void(std::int64_t count, const std::function<void(std::int64_t)>& task)>;

struct CpuEngineOptions {
  // The host's own thread pool, when it has one. An in-process agent passes torch's
  // intra-op (OpenMP) team: a pool of our own fights torch's threads, which spin-wait
  // after each parallel region (measured: no faster than one thread inside a training
  // step; on torch's team the fused pass beats torch's own unscale). Null: the engine's
  // own `threads` threads.
  ParallelFor parallel_for;
  int threads = 0;                       // 0: std::thread::hardware_concurrency()
  CpuIsa isa = CpuIsa::kAuto;            // a forced ISA must be supported by this CPU
  std::int64_t chunk_elements = 1 << 16; // work unit per thread; must be in [1024, 2^24]
};

class ThreadPool;
namespace math {
struct Partial;
}

// Not thread-safe: one engine per training thread (the agent owns one). Buffers and
// worker threads are kept between calls, so a call allocates nothing once warm.
class CpuStatsEngine {
 public:
  explicit CpuStatsEngine(const CpuEngineOptions& options = {});
  ~CpuStatsEngine();
  CpuStatsEngine(const CpuStatsEngine&) = delete;
  CpuStatsEngine& operator=(const CpuStatsEngine&) = delete;

  // Fills out[i] with the statistics of tensors[i]. With `histograms` (count * kHistBins
  // values) also the exponent histograms. Returns true if any tensor holds a NaN or Inf.
  // Throws std::invalid_argument for a malformed TensorRef.
  bool compute(const TensorRef* tensors, std::size_t count, TensorStats* out,
               std::uint64_t* histograms = nullptr);

  // The same statistics, on the values before unscale, and in the same pass every
  // element is replaced by the value torch._amp_foreach_non_finite_check_and_unscale_
  // writes (x * inv_scale in fp32, rounded to nearest even). Returns found_inf.
  bool unscale_and_compute(const MutableTensorRef* tensors, std::size_t count, float inv_scale,
                           TensorStats* out, std::uint64_t* histograms = nullptr);

  // Whether the tensor holds a NaN or Inf: what compute()'s nan + inf say, at a fraction of
  // its cost (an unsigned max over the raw bits: on the calling thread, or in chunks on the
  // host's parallel_for from 256 KiB on). For a value only checked, not recorded. Throws
  // std::invalid_argument for a malformed TensorRef.
  bool has_nonfinite(const TensorRef& tensor) const;

  CpuIsa isa() const { return isa_; }
  int threads() const;

 private:
  struct Job;
  bool run(const TensorRef* tensors, std::size_t count, bool unscale, float inv_scale,
           TensorStats* out, std::uint64_t* histograms);

  CpuIsa isa_;
  std::int64_t chunk_elements_;
  std::unique_ptr<ThreadPool> pool_;
  ParallelFor parallel_for_;
  std::vector<Job> jobs_;
  std::vector<math::Partial> partials_;  // one per job
  std::vector<std::uint32_t> job_histograms_;
};

}  // namespace ampdiag::kernels
