// CpuStatsEngine: splits many tensors into chunks, runs them on the pool, and merges the
// per-chunk partials in chunk order, so results do not depend on the thread count.
#include "ampdiag/kernels/cpu_stats.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>

#include "cpu_chunk.h"
#include "thread_pool.h"

namespace ampdiag::kernels {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto: return "auto";
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512:
      return cpu_isa_supported(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
  }
  return false;
}

CpuIsa best_cpu_isa() {
  if (cpu_isa_supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (cpu_isa_supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kBaseline;
}

struct CpuStatsEngine::Job {
  std::size_t tensor;
  std::int64_t begin;
  std::int64_t count;
};

namespace {

int resolve_threads(int threads) {
  if (threads < 0) throw std::invalid_argument("CpuEngineOptions.threads is negative; use 0 for all cores or a count");
  if (threads > 0) return threads;
  return std::max(1, int(std::thread::hardware_concurrency()));
}

CpuIsa resolve_isa(CpuIsa isa) {
  if (isa == CpuIsa::kAuto) return best_cpu_isa();
  if (!cpu_isa_supported(isa))
    throw std::invalid_argument(std::string("CpuEngineOptions.isa: this CPU does not support ") + cpu_isa_name(isa) +
                                "; use CpuIsa::kAuto");
  return isa;
}

// A pass over fewer values than this runs on the calling thread. Measured inside a training
// step (2 threads, the gradients of MLPs from 10 k to 200 k values): the team's start costs
// more than the second thread saves up to about 64 k values, and where torch's threads have
// gone to sleep (OMP_WAIT_POLICY=PASSIVE, or between a GPU step's host work) waking them
// cost ~65 us for a 10 k-value pass that takes ~4 us alone.
constexpr std::int64_t kInlineElements = std::int64_t(1) << 16;

void check_tensor(const TensorRef& t, std::size_t index) {
  // Runs for every tensor of every pass: the message is built only when there is one.
  const auto where = [index] { return "tensor " + std::to_string(index) + ": "; };
  if (t.numel < 0) throw std::invalid_argument(where() + "numel is " + std::to_string(t.numel) + "; it must be >= 0");
  if (t.numel > 0 && t.data == nullptr)
    throw std::invalid_argument(where() + "data is null but numel is " + std::to_string(t.numel));
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16)
    throw std::invalid_argument(where() + "unknown dtype code " + std::to_string(int(t.dtype)));
}

}  // namespace

CpuStatsEngine::CpuStatsEngine(const CpuEngineOptions& options)
    : isa_(resolve_isa(options.isa)), chunk_elements_(options.chunk_elements) {
  if (chunk_elements_ < 1024 || chunk_elements_ > (std::int64_t(1) << 24))
    throw std::invalid_argument("CpuEngineOptions.chunk_elements is " + std::to_string(chunk_elements_) +
                                "; it must be in [1024, 16777216]");
  parallel_for_ = options.parallel_for;
  pool_ = std::make_unique<ThreadPool>(parallel_for_ ? 1 : resolve_threads(options.threads));
}

CpuStatsEngine::~CpuStatsEngine() = default;

int CpuStatsEngine::threads() const { return pool_->threads(); }

bool CpuStatsEngine::compute(const TensorRef* tensors, std::size_t count, TensorStats* out,
                             std::uint64_t* histograms) {
  return run(tensors, count, false, 1.0f, out, histograms);
}

bool CpuStatsEngine::unscale_and_compute(const MutableTensorRef* tensors, std::size_t count, float inv_scale,
                                         TensorStats* out, std::uint64_t* histograms) {
  static_assert(sizeof(MutableTensorRef) == sizeof(TensorRef), "the two views share one layout");
  // Same layout, and the pointer came in mutable: reading it through TensorRef is sound.
  return run(reinterpret_cast<const TensorRef*>(tensors), count, true, inv_scale, out, histograms);
}

bool CpuStatsEngine::has_nonfinite(const TensorRef& tensor) const {
  check_tensor(tensor, 0);
  const NonfiniteFn fn = nonfinite_fn(isa_);
  const std::size_t size = element_size(tensor.dtype);
  // Large tensors on the host's team only: a module's output was just written by its
  // threads, and one thread alone waits on the half that sits in the other core's cache.
  // Measured inside a training step (2 threads): 256 KiB took 7.8 µs against 10.6 alone,
  // 512 KiB 13.2 against 20.5; at 128 KiB the team's start costs what it saves. Our own
  // pool would first have to wake up.
  constexpr std::size_t kParallelBytes = std::size_t(256) << 10;
  if (!parallel_for_ || std::size_t(tensor.numel) * size < kParallelBytes || tensor.numel < 2 * chunk_elements_)
    return tensor.numel > 0 && fn(tensor.data, tensor.numel, tensor.dtype);
  const std::int64_t jobs = (tensor.numel + chunk_elements_ - 1) / chunk_elements_;
  std::atomic<bool> found{false};
  parallel_for_(jobs, [&](std::int64_t j) {
    const std::int64_t begin = j * chunk_elements_;
    const std::int64_t count = std::min(chunk_elements_, tensor.numel - begin);
    if (!found.load(std::memory_order_relaxed) &&
        fn(static_cast<const char*>(tensor.data) + std::size_t(begin) * size, count, tensor.dtype))
      found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

bool CpuStatsEngine::run(const TensorRef* tensors, std::size_t count, bool unscale, float inv_scale,
                         TensorStats* out, std::uint64_t* histograms) {
  if (count > 0 && (tensors == nullptr || out == nullptr))
    throw std::invalid_argument("CpuStatsEngine: tensors and out must not be null when count > 0");
  jobs_.clear();
  std::int64_t elements = 0;
  for (std::size_t t = 0; t < count; ++t) {
    check_tensor(tensors[t], t);
    elements += tensors[t].numel;
    for (std::int64_t begin = 0; begin < tensors[t].numel; begin += chunk_elements_)
      jobs_.push_back({t, begin, std::min(chunk_elements_, tensors[t].numel - begin)});
  }
  partials_.resize(jobs_.size());
  if (histograms) job_histograms_.assign(jobs_.size() * kHistBins, 0u);

  const ChunkFn fn = chunk_fn(isa_);
  const std::function<void(std::int64_t)> run_job = [&](std::int64_t j) {
    const Job& job = jobs_[std::size_t(j)];
    const TensorRef& t = tensors[job.tensor];
    const std::size_t offset = std::size_t(job.begin) * element_size(t.dtype);
    ChunkWork work;
    work.src = static_cast<const char*>(t.data) + offset;
    work.dst = unscale ? const_cast<char*>(static_cast<const char*>(t.data)) + offset : nullptr;
    work.count = job.count;
    work.dtype = t.dtype;
    work.inv_scale = inv_scale;
    work.histogram = histograms ? &job_histograms_[std::size_t(j) * kHistBins] : nullptr;
    partials_[std::size_t(j)].reset();
    fn(work, partials_[std::size_t(j)]);
  };
  if (elements < kInlineElements) {
    for (std::size_t j = 0; j < jobs_.size(); ++j) run_job(std::int64_t(j));
  } else if (parallel_for_) {
    parallel_for_(std::int64_t(jobs_.size()), run_job);
  } else {
    pool_->parallel_for(std::int64_t(jobs_.size()), run_job);
  }

  // Jobs are in tensor order and chunk order: merging them in sequence is deterministic.
  bool any_nonfinite = false;
  std::size_t j = 0;
  for (std::size_t t = 0; t < count; ++t) {
    math::Partial total;
    total.reset();
    if (histograms) std::fill_n(histograms + t * kHistBins, kHistBins, std::uint64_t(0));
    for (; j < jobs_.size() && jobs_[j].tensor == t; ++j) {
      total.merge(partials_[j]);
      if (histograms)
        for (int b = 0; b < kHistBins; ++b) histograms[t * kHistBins + b] += job_histograms_[j * kHistBins + b];
    }
    math::finalize(total, tensors[t].numel, out[t]);
    any_nonfinite = any_nonfinite || out[t].has_nonfinite();
  }
  return any_nonfinite;
}

}  // namespace ampdiag::kernels
