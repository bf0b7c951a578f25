// CudaStatsEngine: multi-tensor-apply style statistics (and fused unscale) on the device.
// One block per (tensor, chunk) work item, one launch per dtype present, a per-block
// partial reduced in a fixed tree order; the launch's last block merges each tensor's
// partials in chunk order, so results are deterministic. No float atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampdiag/kernels/cuda_stats.h"
#include "ampdiag/kernels/element_math.h"
#include "cuda_util.h"

namespace ampdiag::kernels {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kChunk = 65536;  // elements per block
constexpr int kFinalizeThreads = 128;

struct DeviceTensor {
  void* data;
  std::int64_t numel;
  std::int32_t first_item;
  std::int32_t items;
};

struct WorkItem {
  std::int32_t tensor;
  std::int32_t chunk;
};

// What the blocks of one launch share. A one-tensor launch (an activation) passes its
// tensor by value and derives its work items, so it needs no descriptor copies; results go
// straight to pinned host memory (device-accessible under unified addressing), so no copy
// back either: a launch is its kernels and one event.
struct LaunchArgs {
  const DeviceTensor* tensors;  // device copies; null: the single tensor `one`
  const WorkItem* items;        // device copies; null: item i is chunk i of `one`
  DeviceTensor one;
  int item_offset;              // of the dtype group this kernel runs
  int count;
  unsigned total_blocks;        // over all the launch's kernels
  unsigned* finished;           // blocks done so far; the last block resets it to 0
  math::Partial* partials;      // per item
  std::uint32_t* histograms;    // per item, or null
  const float* inv_scale;
  float* found_inf;
  TensorStats* out;             // pinned host memory
  std::uint64_t* histograms_out;  // pinned host memory, or null
};

__device__ DeviceTensor tensor_at(const LaunchArgs& a, int t) { return a.tensors ? a.tensors[t] : a.one; }
__device__ WorkItem item_at(const LaunchArgs& a, int i) { return a.items ? a.items[i] : WorkItem{0, i}; }

// Another block's partials, read past this SM's L1 (written before that block's fence).
__device__ math::Partial load_partial(const math::Partial* p) {
  math::Partial v;
  v.nan = __ldcg(reinterpret_cast<const long long*>(&p->nan));
  v.inf = __ldcg(reinterpret_cast<const long long*>(&p->inf));
  v.zeros = __ldcg(reinterpret_cast<const long long*>(&p->zeros));
  v.subnormal = __ldcg(reinterpret_cast<const long long*>(&p->subnormal));
  v.max_bits = __ldcg(&p->max_bits);
  v.min_nz_bits = __ldcg(&p->min_nz_bits);
  v.sumsq = __ldcg(&p->sumsq);
  return v;
}

// Tensor t's partials merged in chunk order (deterministic), into the results.
__device__ void finalize_tensor(const LaunchArgs& a, int t) {
  const DeviceTensor tensor = tensor_at(a, t);
  math::Partial total;
  total.reset();
  for (int k = 0; k < tensor.items; ++k) total.merge(load_partial(&a.partials[tensor.first_item + k]));
  math::finalize(total, tensor.numel, a.out[t]);
}

// Bin b of tensor t's histogram summed over its chunks. One thread per (tensor, bin): per
// tensor, the sums over a large tensor's chunks took longer than the statistics pass.
__device__ void finalize_bin(const LaunchArgs& a, int t, int b) {
  const DeviceTensor tensor = tensor_at(a, t);
  std::uint64_t sum = 0;
  for (int k = 0; k < tensor.items; ++k) sum += __ldcg(&a.histograms[std::int64_t(tensor.first_item + k) * kHistBins + b]);
  a.histograms_out[std::int64_t(t) * kHistBins + b] = sum;
}

template <DType D, bool kUnscale>
__global__ void __launch_bounds__(kThreads) stats_kernel(const LaunchArgs a) {
  __shared__ math::Partial block_partials[kThreads];
  __shared__ std::uint32_t block_histogram[kHistBins];
  __shared__ bool last_block;
  const int item_index = a.item_offset + int(blockIdx.x);
  const WorkItem item = item_at(a, item_index);
  const DeviceTensor t = tensor_at(a, item.tensor);
  const std::int64_t begin = std::int64_t(item.chunk) * kChunk;
  const std::int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
  const float inv = kUnscale ? *a.inv_scale : 1.0f;

  if (a.histograms) {
    for (int b = threadIdx.x; b < kHistBins; b += kThreads) block_histogram[b] = 0;
    __syncthreads();
  }
  math::ScalarAccumulator acc;
  acc.reset();
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const std::uint32_t bits = math::load_f32_bits<D>(t.data, i);
    acc.add(bits);
    if (a.histograms) {
      const int bin = math::hist_bin(bits);
      if (bin >= 0) atomicAdd(&block_histogram[bin], 1u);  // integer: order does not matter
    }
    if constexpr (kUnscale) math::store_f32_bits<D>(t.data, i, math::unscale_bits(bits, inv));
  }

  math::Partial mine;
  mine.reset();
  math::fold(acc, mine);
  block_partials[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (int(threadIdx.x) < stride) block_partials[threadIdx.x].merge(block_partials[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    a.partials[item_index] = block_partials[0];
    // Every block that sees one writes the same 1.0f: a benign race, as in torch.
    if (a.found_inf && (block_partials[0].nan != 0 || block_partials[0].inf != 0)) *a.found_inf = 1.0f;
  }
  if (a.histograms) {
    for (int b = threadIdx.x; b < kHistBins; b += kThreads)
      a.histograms[std::int64_t(item_index) * kHistBins + b] = block_histogram[b];
  }
  // The last block of the launch to finish merges every tensor's partials: no second kernel.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(a.finished, 1u) == a.total_blocks - 1;
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  for (int k = threadIdx.x; k < a.count; k += kThreads) finalize_tensor(a, k);
  if (a.histograms)
    for (std::int64_t k = threadIdx.x; k < std::int64_t(a.count) * kHistBins; k += kThreads)
      finalize_bin(a, int(k / kHistBins), int(k % kHistBins));
  if (threadIdx.x == 0) *a.finished = 0;  // for the slot's next launch (after this one's event)
}

// A launch whose tensors are all empty has no stats blocks: its results come from here.
__global__ void finalize_kernel(const LaunchArgs a) {
  const int t = int(blockIdx.x) * kFinalizeThreads + int(threadIdx.x);
  if (t >= a.count) return;
  finalize_tensor(a, t);
  if (a.histograms)
    for (int b = 0; b < kHistBins; ++b) finalize_bin(a, t, b);
}

// Buffers grow to the next power of two: cudaFree and cudaFreeHost synchronise the device,
// so a slot should regrow rarely, not for every slightly larger launch.
inline std::size_t grown(std::size_t need) {
  std::size_t capacity = 1;
  while (capacity < need) capacity *= 2;
  return capacity;
}

// Each returns 1 when it allocated, else 0 (CudaStatsEngine::allocations() sums them).
template <class T>
int ensure_host(T*& ptr, std::size_t& capacity, std::size_t need) {
  if (need <= capacity) return 0;
  if (ptr) AMPDIAG_CUDA_CHECK(cudaFreeHost(ptr));
  ptr = nullptr;
  capacity = 0;
  AMPDIAG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ptr), grown(need) * sizeof(T)));
  capacity = grown(need);
  return 1;
}

template <class T>
int ensure_device(T*& ptr, std::size_t& capacity, std::size_t need) {
  if (need <= capacity) return 0;
  if (ptr) AMPDIAG_CUDA_CHECK(cudaFree(ptr));
  ptr = nullptr;
  capacity = 0;
  AMPDIAG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), grown(need) * sizeof(T)));
  capacity = grown(need);
  return 1;
}

std::once_flag g_probe_once;
bool g_available = false;
std::string g_reason;

void probe_device() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    g_reason = std::string("CUDA runtime: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
  } else if (count == 0) {
    g_reason = "CUDA runtime: no device";
  } else {
    g_available = true;
  }
}

}  // namespace

bool cuda_device_available() {
  std::call_once(g_probe_once, probe_device);
  return g_available;
}

std::string cuda_unavailable_reason() {
  std::call_once(g_probe_once, probe_device);
  return g_reason;
}

struct CudaStatsEngine::Slot final : CudaTicket {
  cudaEvent_t done = nullptr;
  bool in_flight = false;
  bool held = false;
  std::size_t tensor_count = 0;
  bool with_histogram = false;

  DeviceTensor* host_tensors = nullptr;
  WorkItem* host_items = nullptr;
  TensorStats* host_stats = nullptr;
  std::uint64_t* host_histograms = nullptr;
  std::size_t host_tensors_cap = 0, host_items_cap = 0, host_stats_cap = 0, host_hist_cap = 0;

  DeviceTensor* dev_tensors = nullptr;
  WorkItem* dev_items = nullptr;
  math::Partial* dev_partials = nullptr;
  std::uint32_t* dev_item_histograms = nullptr;
  unsigned* dev_finished = nullptr;  // LaunchArgs::finished, zeroed once
  std::size_t dev_tensors_cap = 0, dev_items_cap = 0, dev_partials_cap = 0, dev_item_hist_cap = 0;

  ~Slot() override {
    // Destructors must not throw: release what can be released.
    if (done) {
      cudaEventSynchronize(done);
      cudaEventDestroy(done);
    }
    cudaFreeHost(host_tensors);
    cudaFreeHost(host_items);
    cudaFreeHost(host_stats);
    cudaFreeHost(host_histograms);
    cudaFree(dev_tensors);
    cudaFree(dev_items);
    cudaFree(dev_partials);
    cudaFree(dev_item_histograms);
    cudaFree(dev_finished);
  }

  bool ready() override { return event_passed(done, in_flight); }

  // How large its buffers are, to prefer the smallest slot that fits (0: never used).
  std::size_t size() const {
    return host_stats_cap + dev_partials_cap + host_tensors_cap + host_items_cap + host_hist_cap;
  }

  // Whether a launch of `count` tensors in `items` chunks runs without allocating.
  bool fits(std::size_t count, std::size_t items, bool histogram) const {
    count = std::max<std::size_t>(count, 1);
    items = std::max<std::size_t>(items, 1);
    const bool descriptors = count == 1 || (count <= host_tensors_cap && items <= host_items_cap &&
                                            count <= dev_tensors_cap && items <= dev_items_cap);
    return descriptors && count <= host_stats_cap && items <= dev_partials_cap && dev_finished &&
           (!histogram || (count * kHistBins <= host_hist_cap && items * kHistBins <= dev_item_hist_cap));
  }

  void wait() override {
    if (!in_flight) return;
    AMPDIAG_CUDA_CHECK(cudaEventSynchronize(done));
    in_flight = false;
  }

  const TensorStats* stats() const override { return host_stats; }
  const std::uint64_t* histograms() const override { return with_histogram ? host_histograms : nullptr; }
  std::size_t count() const override { return tensor_count; }
  void release() override { held = false; }
};

CudaStatsEngine::CudaStatsEngine(int slots, int device) : slot_count_(slots), device_(device) {
  check_slot_pool("CudaStatsEngine", slots, device);
  const DeviceScope scope(device);
  slots_ = std::make_unique<Slot[]>(std::size_t(slots));
  for (int s = 0; s < slots; ++s)
    AMPDIAG_CUDA_CHECK(cudaEventCreateWithFlags(&slots_[std::size_t(s)].done, cudaEventDisableTiming));
}

CudaStatsEngine::~CudaStatsEngine() = default;

CudaTicket* CudaStatsEngine::launch(const TensorRef* tensors, std::size_t count, const CudaLaunch& launch) {
  if (count > 0 && tensors == nullptr) throw std::invalid_argument("CudaStatsEngine::launch: tensors is null");
  if (count > std::size_t(INT32_MAX)) throw std::invalid_argument("CudaStatsEngine::launch: too many tensors");
  // Plan: work items grouped by dtype, each tensor's chunks contiguous and in order.
  std::size_t item_count = 0;
  for (std::size_t t = 0; t < count; ++t) {
    const TensorRef& ref = tensors[t];
    const auto fail = [t](const std::string& what) {
      throw std::invalid_argument("CudaStatsEngine::launch: tensor " + std::to_string(t) + ": " + what);
    };
    if (ref.numel < 0) fail("numel is negative");
    if (ref.numel > 0 && !ref.data) fail("data is null");
    if (ref.dtype != DType::kFloat32 && ref.dtype != DType::kFloat16 && ref.dtype != DType::kBFloat16)
      fail("unknown dtype code " + std::to_string(int(ref.dtype)));
    if (reinterpret_cast<std::uintptr_t>(ref.data) % element_size(ref.dtype) != 0)
      fail("data is not aligned to its element size");
    item_count += std::size_t((ref.numel + kChunk - 1) / kChunk);
  }
  if (item_count > std::size_t(INT32_MAX)) throw std::invalid_argument("CudaStatsEngine::launch: too many chunks");
  // The smallest free slot whose buffers fit; else a never used one (allocating there frees
  // nothing, and freeing is what synchronises); else the lowest free one, which grows. Small
  // launches then keep to small slots and large ones find the large slots they grew, so a
  // steady launch pattern stops allocating after its first steps.
  Slot* fitting = nullptr;
  Slot* unused = nullptr;
  Slot* any = nullptr;
  for (int k = 0; k < slot_count_; ++k) {
    Slot& candidate = slots_[std::size_t(k)];
    if (candidate.held || !candidate.ready()) continue;
    if (!any) any = &candidate;
    if (candidate.fits(count, item_count, launch.histogram)) {
      if (!fitting || candidate.size() < fitting->size()) fitting = &candidate;
    } else if (!unused && !candidate.dev_finished) {
      unused = &candidate;
    }
  }
  Slot* slot = fitting ? fitting : unused ? unused : any;
  if (!slot) return nullptr;  // all held: drop, never wait on the training thread
  const DeviceScope scope(device_);
  auto stream = static_cast<cudaStream_t>(launch.stream);
  const std::size_t tensors_need = std::max<std::size_t>(count, 1), items_need = std::max<std::size_t>(item_count, 1);
  const bool one = count == 1;  // the tensor goes by value: no descriptors to copy
  if (!one)
    allocations_ += ensure_host(slot->host_tensors, slot->host_tensors_cap, tensors_need) +
                    ensure_host(slot->host_items, slot->host_items_cap, items_need) +
                    ensure_device(slot->dev_tensors, slot->dev_tensors_cap, tensors_need) +
                    ensure_device(slot->dev_items, slot->dev_items_cap, items_need);
  allocations_ += ensure_host(slot->host_stats, slot->host_stats_cap, tensors_need) +
                  ensure_device(slot->dev_partials, slot->dev_partials_cap, items_need);
  if (launch.histogram)
    allocations_ += ensure_host(slot->host_histograms, slot->host_hist_cap, tensors_need * kHistBins) +
                    ensure_device(slot->dev_item_histograms, slot->dev_item_hist_cap, items_need * kHistBins);
  if (!slot->dev_finished) {
    AMPDIAG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slot->dev_finished), sizeof(unsigned)));
    AMPDIAG_CUDA_CHECK(cudaMemsetAsync(slot->dev_finished, 0, sizeof(unsigned), stream));
    ++allocations_;
  }

  const DType order[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  int group_begin[3] = {0, 0, 0};
  int group_size[3] = {0, 0, 0};
  LaunchArgs args{};
  args.count = int(count);
  args.total_blocks = unsigned(item_count);
  args.finished = slot->dev_finished;
  args.partials = slot->dev_partials;
  args.histograms = launch.histogram ? slot->dev_item_histograms : nullptr;
  args.inv_scale = launch.inv_scale;
  args.found_inf = launch.found_inf;
  args.out = slot->host_stats;  // pinned: the device writes it in place (unified addressing)
  args.histograms_out = launch.histogram ? slot->host_histograms : nullptr;
  if (one) {
    const auto chunks = std::int32_t((tensors[0].numel + kChunk - 1) / kChunk);
    args.one = {const_cast<void*>(tensors[0].data), tensors[0].numel, 0, chunks};
    for (int g = 0; g < 3; ++g) group_size[g] = tensors[0].dtype == order[g] ? chunks : 0;
  } else {
    std::int32_t next_item = 0;
    for (int g = 0; g < 3; ++g) {
      group_begin[g] = next_item;
      for (std::size_t t = 0; t < count; ++t) {
        if (tensors[t].dtype != order[g]) continue;
        const auto chunks = std::int32_t((tensors[t].numel + kChunk - 1) / kChunk);
        slot->host_tensors[t] = {const_cast<void*>(tensors[t].data), tensors[t].numel, next_item, chunks};
        for (std::int32_t c = 0; c < chunks; ++c) slot->host_items[next_item + c] = {std::int32_t(t), c};
        next_item += chunks;
      }
      group_size[g] = next_item - group_begin[g];
    }
    if (count > 0) {
      AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->dev_tensors, slot->host_tensors, count * sizeof(DeviceTensor),
                                         cudaMemcpyHostToDevice, stream));
      if (item_count > 0)
        AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->dev_items, slot->host_items, item_count * sizeof(WorkItem),
                                           cudaMemcpyHostToDevice, stream));
    }
    args.tensors = slot->dev_tensors;
    args.items = slot->dev_items;
  }

  const bool unscale = launch.inv_scale != nullptr;
  for (int g = 0; g < 3; ++g) {
    if (group_size[g] == 0) continue;
    args.item_offset = group_begin[g];
    const dim3 grid = dim3(unsigned(group_size[g]));  // not grid(...): that parses as a declaration
    const auto run = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(args); };
    switch (order[g]) {
      case DType::kFloat32:
        unscale ? run(stats_kernel<DType::kFloat32, true>) : run(stats_kernel<DType::kFloat32, false>);
        break;
      case DType::kFloat16:
        unscale ? run(stats_kernel<DType::kFloat16, true>) : run(stats_kernel<DType::kFloat16, false>);
        break;
      case DType::kBFloat16:
        unscale ? run(stats_kernel<DType::kBFloat16, true>) : run(stats_kernel<DType::kBFloat16, false>);
        break;
    }
    AMPDIAG_CUDA_CHECK(cudaGetLastError());
  }
  if (item_count == 0 && count > 0) {
    const unsigned blocks = unsigned((count + kFinalizeThreads - 1) / kFinalizeThreads);
    finalize_kernel<<<blocks, kFinalizeThreads, 0, stream>>>(args);
    AMPDIAG_CUDA_CHECK(cudaGetLastError());
  }
  AMPDIAG_CUDA_CHECK(cudaEventRecord(slot->done, stream));
  slot->in_flight = true;
  slot->held = true;
  slot->tensor_count = count;
  slot->with_histogram = launch.histogram;
  return slot;
}

}  // namespace ampdiag::kernels
