// CudaStatsEngine: multi-tensor-apply style statistics (and fused unscale) on the device.
// One block per (tensor, chunk) work item, one launch per dtype present, a per-block
// partial reduced in a fixed tree order, then one small kernel merging each tensor's
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

template <DType D, bool kUnscale>
__global__ void __launch_bounds__(kThreads)
    stats_kernel(const DeviceTensor* tensors, const WorkItem* items, int item_offset, math::Partial* partials,
                 std::uint32_t* histograms, const float* inv_scale, float* found_inf) {
  __shared__ math::Partial block_partials[kThreads];
  __shared__ std::uint32_t block_histogram[kHistBins];
  const int item_index = item_offset + int(blockIdx.x);
  const WorkItem item = items[item_index];
  const DeviceTensor t = tensors[item.tensor];
  const std::int64_t begin = std::int64_t(item.chunk) * kChunk;
  const std::int64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
  const float inv = kUnscale ? *inv_scale : 1.0f;

  if (histograms) {
    for (int b = threadIdx.x; b < kHistBins; b += kThreads) block_histogram[b] = 0;
    __syncthreads();
  }
  math::ScalarAccumulator acc;
  acc.reset();
  for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const std::uint32_t bits = math::load_f32_bits<D>(t.data, i);
    acc.add(bits);
    if (histograms) {
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
    partials[item_index] = block_partials[0];
    // Every block that sees one writes the same 1.0f: a benign race, as in torch.
    if (found_inf && (block_partials[0].nan != 0 || block_partials[0].inf != 0)) *found_inf = 1.0f;
  }
  if (histograms) {
    for (int b = threadIdx.x; b < kHistBins; b += kThreads)
      histograms[std::int64_t(item_index) * kHistBins + b] = block_histogram[b];
  }
}

__global__ void finalize_kernel(const DeviceTensor* tensors, int count, const math::Partial* partials,
                                const std::uint32_t* histograms, TensorStats* out, std::uint64_t* histograms_out) {
  const int t = int(blockIdx.x) * kFinalizeThreads + int(threadIdx.x);
  if (t >= count) return;
  const DeviceTensor tensor = tensors[t];
  math::Partial total;
  total.reset();
  for (int k = 0; k < tensor.items; ++k) total.merge(partials[tensor.first_item + k]);
  math::finalize(total, tensor.numel, out[t]);
  if (histograms) {
    for (int b = 0; b < kHistBins; ++b) {
      std::uint64_t sum = 0;
      for (int k = 0; k < tensor.items; ++k) sum += histograms[std::int64_t(tensor.first_item + k) * kHistBins + b];
      histograms_out[std::int64_t(t) * kHistBins + b] = sum;
    }
  }
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
  TensorStats* dev_stats = nullptr;
  std::uint64_t* dev_histograms = nullptr;
  std::size_t dev_tensors_cap = 0, dev_items_cap = 0, dev_partials_cap = 0, dev_item_hist_cap = 0,
              dev_stats_cap = 0, dev_hist_cap = 0;

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
    cudaFree(dev_stats);
    cudaFree(dev_histograms);
  }

  bool ready() override { return event_passed(done, in_flight); }

  // How large its buffers are, to prefer the smallest slot that fits (0: never used).
  std::size_t size() const { return host_items_cap + host_tensors_cap + host_hist_cap; }

  // Whether a launch of `count` tensors in `items` chunks runs without allocating.
  bool fits(std::size_t count, std::size_t items, bool histogram) const {
    count = std::max<std::size_t>(count, 1);
    items = std::max<std::size_t>(items, 1);
    return count <= host_tensors_cap && items <= host_items_cap && count <= host_stats_cap &&
           count <= dev_tensors_cap && items <= dev_items_cap && items <= dev_partials_cap && count <= dev_stats_cap &&
           (!histogram || (count * kHistBins <= host_hist_cap && items * kHistBins <= dev_item_hist_cap &&
                           count * kHistBins <= dev_hist_cap));
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
    const std::string where = "CudaStatsEngine::launch: tensor " + std::to_string(t) + ": ";
    if (ref.numel < 0) throw std::invalid_argument(where + "numel is negative");
    if (ref.numel > 0 && !ref.data) throw std::invalid_argument(where + "data is null");
    if (ref.dtype != DType::kFloat32 && ref.dtype != DType::kFloat16 && ref.dtype != DType::kBFloat16)
      throw std::invalid_argument(where + "unknown dtype code " + std::to_string(int(ref.dtype)));
    if (reinterpret_cast<std::uintptr_t>(ref.data) % element_size(ref.dtype) != 0)
      throw std::invalid_argument(where + "data is not aligned to its element size");
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
    } else if (!unused && candidate.size() == 0) {
      unused = &candidate;
    }
  }
  Slot* slot = fitting ? fitting : unused ? unused : any;
  if (!slot) return nullptr;  // all held: drop, never wait on the training thread
  const DeviceScope scope(device_);
  const std::size_t tensors_need = std::max<std::size_t>(count, 1), items_need = std::max<std::size_t>(item_count, 1);
  allocations_ += ensure_host(slot->host_tensors, slot->host_tensors_cap, tensors_need) +
                  ensure_host(slot->host_items, slot->host_items_cap, items_need) +
                  ensure_host(slot->host_stats, slot->host_stats_cap, tensors_need) +
                  ensure_device(slot->dev_tensors, slot->dev_tensors_cap, tensors_need) +
                  ensure_device(slot->dev_items, slot->dev_items_cap, items_need) +
                  ensure_device(slot->dev_partials, slot->dev_partials_cap, items_need) +
                  ensure_device(slot->dev_stats, slot->dev_stats_cap, tensors_need);
  if (launch.histogram)
    allocations_ += ensure_host(slot->host_histograms, slot->host_hist_cap, tensors_need * kHistBins) +
                    ensure_device(slot->dev_item_histograms, slot->dev_item_hist_cap, items_need * kHistBins) +
                    ensure_device(slot->dev_histograms, slot->dev_hist_cap, tensors_need * kHistBins);

  const DType order[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  int group_begin[3] = {0, 0, 0};
  int group_size[3] = {0, 0, 0};
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

  auto stream = static_cast<cudaStream_t>(launch.stream);
  const bool unscale = launch.inv_scale != nullptr;
  std::uint32_t* item_hist = launch.histogram ? slot->dev_item_histograms : nullptr;
  AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->dev_tensors, slot->host_tensors, count * sizeof(DeviceTensor),
                                     cudaMemcpyHostToDevice, stream));
  AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->dev_items, slot->host_items, item_count * sizeof(WorkItem),
                                     cudaMemcpyHostToDevice, stream));
  for (int g = 0; g < 3; ++g) {
    if (group_size[g] == 0) continue;
    const dim3 grid = dim3(unsigned(group_size[g]));  // not grid(...): that parses as a declaration
    const auto args = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, stream>>>(slot->dev_tensors, slot->dev_items, group_begin[g], slot->dev_partials,
                                            item_hist, launch.inv_scale, launch.found_inf);
    };
    switch (order[g]) {
      case DType::kFloat32:
        unscale ? args(stats_kernel<DType::kFloat32, true>) : args(stats_kernel<DType::kFloat32, false>);
        break;
      case DType::kFloat16:
        unscale ? args(stats_kernel<DType::kFloat16, true>) : args(stats_kernel<DType::kFloat16, false>);
        break;
      case DType::kBFloat16:
        unscale ? args(stats_kernel<DType::kBFloat16, true>) : args(stats_kernel<DType::kBFloat16, false>);
        break;
    }
    AMPDIAG_CUDA_CHECK(cudaGetLastError());
  }
  if (count > 0) {
    const unsigned blocks = unsigned((count + kFinalizeThreads - 1) / kFinalizeThreads);
    finalize_kernel<<<blocks, kFinalizeThreads, 0, stream>>>(slot->dev_tensors, int(count), slot->dev_partials,
                                                             item_hist, slot->dev_stats,
                                                             launch.histogram ? slot->dev_histograms : nullptr);
    AMPDIAG_CUDA_CHECK(cudaGetLastError());
    AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->host_stats, slot->dev_stats, count * sizeof(TensorStats),
                                       cudaMemcpyDeviceToHost, stream));
    if (launch.histogram)
      AMPDIAG_CUDA_CHECK(cudaMemcpyAsync(slot->host_histograms, slot->dev_histograms,
                                         count * kHistBins * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, stream));
  }
  AMPDIAG_CUDA_CHECK(cudaEventRecord(slot->done, stream));
  slot->in_flight = true;
  slot->held = true;
  slot->tensor_count = count;
  slot->with_histogram = launch.histogram;
  return slot;
}

}  // namespace ampdiag::kernels
