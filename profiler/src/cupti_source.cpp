// The CUPTI Activity API behind ActivitySource. libcupti is opened at start() rather
// than linked: the agent (and the Python extension) load where CUPTI is absent, and
// profiling then says why it is unavailable. Records are parsed in CUPTI's buffer
// callback (CUPTI's own thread, or the thread that flushes at stop()), never in a hook.
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "ampdiag/profiler/activity.h"

namespace ampdiag::profiler {

namespace {

constexpr std::size_t kBufferBytes = std::size_t(4) << 20;
constexpr std::size_t kBufferAlign = 8;  // CUPTI's requirement for activity buffers
constexpr std::uint32_t kFlushPeriodMs = 200;
constexpr CUpti_ExternalCorrelationKind kExternalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
// DRIVER and RUNTIME records are not read, but CUPTI emits EXTERNAL_CORRELATION records
// only for API calls it traces: without them (seen on an H100, CUDA 13.0) no kernel or
// copy carries its range.
struct RecordedKind {
  CUpti_ActivityKind kind;
  const char* enable_call;  // for the message when enabling it fails
};
constexpr RecordedKind kRecorded[] = {
    {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "cuptiActivityEnable(CONCURRENT_KERNEL)"},
    {CUPTI_ACTIVITY_KIND_MEMCPY, "cuptiActivityEnable(MEMCPY)"},
    {CUPTI_ACTIVITY_KIND_DRIVER, "cuptiActivityEnable(DRIVER)"},
    {CUPTI_ACTIVITY_KIND_RUNTIME, "cuptiActivityEnable(RUNTIME)"},
};

struct CuptiApi {
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityFlushPeriod) flush_period = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityPushExternalCorrelationId) push = nullptr;
  decltype(&cuptiActivityPopExternalCorrelationId) pop = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;

  // "" or why CUPTI cannot be used.
  std::string load() {
    void* handle = nullptr;
    // torch's CUDA build has usually loaded it already (its profiler links it).
    for (const char* name : {"libcupti.so.13", "libcupti.so"}) {
      if ((handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD))) break;
      if ((handle = dlopen(name, RTLD_NOW))) break;
    }
    if (!handle) {
      const char* why = dlerror();
      return std::string("libcupti.so could not be loaded (") + (why ? why : "not found") +
             "): install CUPTI (the CUDA toolkit's, or the nvidia-cuda-cupti wheel) or put it on LD_LIBRARY_PATH";
    }
    bool ok = true;
    auto get = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol));
      ok = ok && fn != nullptr;
    };
    get(enable, "cuptiActivityEnable");
    get(disable, "cuptiActivityDisable");
    get(register_callbacks, "cuptiActivityRegisterCallbacks");
    get(flush_all, "cuptiActivityFlushAll");
    get(next_record, "cuptiActivityGetNextRecord");
    get(push, "cuptiActivityPushExternalCorrelationId");
    get(pop, "cuptiActivityPopExternalCorrelationId");
    get(result_string, "cuptiGetResultString");
    if (!ok) return "libcupti.so lacks the Activity API this ampdiag uses (CUPTI from CUDA 12 or later is needed)";
    flush_period = reinterpret_cast<decltype(flush_period)>(dlsym(handle, "cuptiActivityFlushPeriod"));  // optional
    return "";
  }

  std::string describe(const char* call, CUptiResult r) const {
    const char* text = nullptr;
    if (!result_string || result_string(r, &text) != CUPTI_SUCCESS || !text) text = "unknown error";
    return std::string(call) + " failed: " + text + " (" + std::to_string(int(r)) + ")";
  }
};

// "" when the CUDA driver is there and sees a device, else why not. Checked before CUPTI
// is touched: some libcupti builds recurse until the stack overflows in
// cuptiActivityRegisterCallbacks when there is no driver to load (seen with the
// nvidia-cuda-cupti wheel of CUDA 13).
std::string driver_ready() {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) return "no CUDA driver (libcuda.so.1 could not be loaded)";
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  const auto init = reinterpret_cast<Init>(dlsym(cuda, "cuInit"));
  const auto count = reinterpret_cast<Count>(dlsym(cuda, "cuDeviceGetCount"));
  if (!init || !count) return "the CUDA driver lacks cuInit/cuDeviceGetCount";
  int devices = 0;
  if (const int r = init(0); r != 0) return "the CUDA driver did not initialise (cuInit error " + std::to_string(r) + ")";
  if (count(&devices) != 0 || devices == 0) return "no CUDA device";
  return "";
}

std::string demangle(const char* name) {
  if (!name) return "";
  int status = 0;
  char* readable = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && readable ? readable : name;
  std::free(readable);
  return out;
}

class CuptiSource;
// CUPTI's buffer callbacks carry no user pointer: one source per process records.
std::mutex g_mutex;
CuptiSource* g_active = nullptr;

class CuptiSource final : public ActivitySource {
 public:
  ~CuptiSource() override { stop(); }

  std::string start() override {
    if (std::string why = driver_ready(); !why.empty()) return why;
    if (std::string why = api_.load(); !why.empty()) return why;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_active) return "another ampdiag session in this process is already profiling";
      g_active = this;
    }
    std::string why = enable_all();
    if (!why.empty()) {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_active = nullptr;
      return why;
    }
    started_ = true;
    return "";
  }

  void set_recording(bool on) override {
    if (!started_ || on == recording_) return;
    for (const RecordedKind& k : kRecorded) on ? api_.enable(k.kind) : api_.disable(k.kind);
    recording_ = on;
  }

  void push_range(std::uint64_t external_id) override {
    if (started_) api_.push(kExternalKind, external_id);
  }

  void pop_range() override {
    std::uint64_t last = 0;
    if (started_) api_.pop(kExternalKind, &last);
  }

  void collect(ActivityBatch& out) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    out.append(std::move(pending_));
  }

  void stop() override {
    if (!started_) return;
    set_recording(false);
    api_.disable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
    api_.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // completes the buffers here
    std::lock_guard<std::mutex> lock(g_mutex);
    g_active = nullptr;
    started_ = false;
  }

  std::string name() const override { return "CUPTI activity API"; }

  // CUPTI's callback, g_mutex held.
  void parse(std::uint8_t* buffer, std::size_t valid) {
    CUpti_Activity* record = nullptr;
    while (api_.next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
          pending_.kernels.push_back({demangle(k->name), k->start, k->end, k->deviceId, k->streamId, k->correlationId});
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
          pending_.copies.push_back({m->start, m->end, m->bytes, m->deviceId, m->streamId, m->correlationId});
          break;
        }
        case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
          const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
          if (e->externalKind == kExternalKind) pending_.externals.push_back({e->correlationId, e->externalId});
          break;
        }
        default:
          break;
      }
    }
  }

 private:
  std::string enable_all() {
    if (CUptiResult r = api_.register_callbacks(&buffer_requested, &buffer_completed); r != CUPTI_SUCCESS)
      return api_.describe("cuptiActivityRegisterCallbacks", r);
    // Enabling is where CUPTI meets the driver: no driver, no device or a profiler that
    // holds the device fail here.
    if (CUptiResult r = api_.enable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION); r != CUPTI_SUCCESS)
      return api_.describe("cuptiActivityEnable(EXTERNAL_CORRELATION)", r);
    for (const RecordedKind& k : kRecorded) {
      if (CUptiResult r = api_.enable(k.kind); r != CUPTI_SUCCESS) {
        api_.disable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
        for (const RecordedKind& other : kRecorded) api_.disable(other.kind);
        return api_.describe(k.enable_call, r);
      }
    }
    for (const RecordedKind& k : kRecorded) api_.disable(k.kind);  // on for sampled steps only
    if (api_.flush_period) api_.flush_period(kFlushPeriodMs);
    return "";
  }

  static void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
    *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
    *size = *buffer ? kBufferBytes : 0;
    *max_records = 0;
  }

  static void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t, std::size_t valid) {
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (g_active && buffer) g_active->parse(buffer, valid);
    }
    std::free(buffer);
  }

  CuptiApi api_;
  bool started_ = false, recording_ = false;
  ActivityBatch pending_;  // g_mutex
};

}  // namespace

std::unique_ptr<ActivitySource> make_cupti_source() { return std::make_unique<CuptiSource>(); }

}  // namespace ampdiag::profiler
