// Where a tensor's statistics are computed: host tensors on the CPU engine at once, device
// tensors on their device's engine, enqueued on the tensor's stream and landing later as
// a ticket. No tensor is ever copied to the host to be read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ampdiag/kernels/tensor_stats.h"
#include "ticket.h"

namespace ampdiag::agent {

enum class DeviceType : std::uint8_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && (type == DeviceType::kCpu || index == o.index); }
};

// A dense tensor as an agent hands it over: its first element, count and dtype; for a
// device tensor also the stream its producer ran on (cudaStream_t; null: the default).
struct DeviceTensor {
  kernels::TensorRef ref;
  Device device;
  void* stream = nullptr;
};

enum class EngineKind : std::uint8_t { kCpu = 0, kCuda = 1, kNone = 2 };
const char* engine_name(EngineKind k);

// One launch on a device: tensors of one device and one stream.
struct DeviceLaunch {
  Device device;
  void* stream = nullptr;
  const float* inv_scale = nullptr;  // device pointer: unscale in place when set
  float* found_inf = nullptr;        // device pointer: set to 1 on NaN/Inf (torch's found_inf)
  bool histogram = false;
};

// What a device ticket writes when it lands: gradient rows (layers and arrival orders, in
// launch order) or one activation row.
struct LandAs {
  bool activation = false;
  std::vector<std::int64_t> ids;     // layers, or the one module
  std::vector<std::int64_t> orders;  // bwd_order per layer, or the fwd_order
  std::int32_t micro_batch = 0;
};

// Scalars of a step's outcome that live on a device (a CUDA run keeps its loss scale,
// found_inf and loss there): read back without the training thread waiting, they
// complete the step when they land.
struct DeviceOutcome {
  enum Field : unsigned {
    kLoss = 1u << 0,
    kScaleBefore = 1u << 1,
    kScaleAfter = 1u << 2,
    kFoundInf = 1u << 3,
    kSkippedIsFoundInf = 1u << 4,  // the optimizer skipped exactly when found_inf (torch's fused optimizers)
  };
  static constexpr std::size_t kValues = 4;  // loss, scale_before, scale_after, found_inf (as double)
  Device device;
  void* stream = nullptr;
  const double* values = nullptr;  // device pointer to kValues doubles, produced on `stream`
  unsigned fields = 0;             // which of them the step takes
};
// Writes the landed values into the step's outcome, as `fields` says.
void apply_outcome(const DeviceOutcome& o, const double* values, StepOutcome& into);

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  virtual EngineKind kind() const = 0;
  // Why the engine cannot run (no device, no driver); empty when it can.
  virtual std::string unavailable() const = 0;
  // Enqueues the pass; the ticket lands the rows described by `as`. Null when the engine
  // has no free slot now: the caller drops this sample (never waits). Throws
  // std::runtime_error on device errors.
  virtual std::unique_ptr<Ticket> launch(const kernels::TensorRef* tensors, std::size_t count,
                                         const DeviceLaunch& launch, LandAs as) = 0;
  // Enqueues the copy of o.values to the host; the ticket completes the step's outcome.
  // Null when no slot is free (the step keeps the outcome the adapter gave).
  virtual std::unique_ptr<Ticket> read_outcome(const DeviceOutcome& o) = 0;
};

// The CUDA engine (one kernels::CudaStatsEngine per device, created on first use), or null
// when this build has no CUDA.
std::unique_ptr<DeviceEngine> make_cuda_engine();

}  // namespace ampdiag::agent
