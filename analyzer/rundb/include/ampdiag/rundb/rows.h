// The rows of a run.db, as plain structs: what the writer takes and the reader returns.
// docs/FORMAT.md describes the tables they map to.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ampdiag::rundb {

// Every run.db problem: unreadable, not a run.db, a newer format, a failed write.
// what() is one line that names the file and says what to do.
class RunDbError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Content the writer never writes (a value out of range, a view for a table): one message
// shape for every reader.
[[noreturn]] inline void throw_corrupt(const std::string& path, const std::string& what) {
  throw RunDbError(path + ": corrupt run.db: " + what);
}

// The statistics of one tensor (kernels::TensorStats, without depending on kernels).
struct StatValues {
  std::int64_t numel = 0, nan = 0, inf = 0, zeros = 0, fp16_subnormal = 0;
  double absmax = 0.0, amin_nz = 0.0, l2 = 0.0;
};

// The one list of the statistic columns, in their column order: the schema, the writer,
// the reader and every export walk it instead of spelling the fields out.
struct StatField {
  const char* name;
  std::int64_t StatValues::*count;  // set for the integer columns
  double StatValues::*real;         // set for the REAL columns
};
inline constexpr StatField kStatFields[] = {
    {"numel", &StatValues::numel, nullptr},   {"nan", &StatValues::nan, nullptr},
    {"inf", &StatValues::inf, nullptr},       {"zeros", &StatValues::zeros, nullptr},
    {"fp16_subnormal", &StatValues::fp16_subnormal, nullptr},
    {"absmax", nullptr, &StatValues::absmax}, {"amin_nz", nullptr, &StatValues::amin_nz},
    {"l2", nullptr, &StatValues::l2},
};
inline constexpr int kStatFieldCount = int(sizeof(kStatFields) / sizeof(kStatFields[0]));

// The exponent histogram's bins (docs/FORMAT.md): bin 0 counts finite non-zero |x| below
// 2^kHistMinExp, bin 1 + (e - kHistMinExp) counts 2^e <= |x| < 2^(e+1), the last bin
// |x| >= 2^(kHistMaxExp + 1). The agent asserts that its kernels bin the same way.
inline constexpr int kHistMinExp = -40;
inline constexpr int kHistMaxExp = 20;
inline constexpr int kHistBins = (kHistMaxExp - kHistMinExp + 1) + 2;

struct LayerRow {
  std::int64_t id = 0;        // dense, in the model's parameter order
  std::string name;           // parameter name, e.g. "block1.0.attn.qkv.weight"
  std::string module_path;    // owning module, e.g. "block1.0.attn.qkv"
  std::string module_type;    // e.g. "Linear"; empty when unknown
  std::string dtype;          // "float32", "float16", "bfloat16", ...
  std::string shape;          // "[2304, 768]"
  std::int64_t numel = 0;
  bool trainable = true;      // requires_grad
  std::string source;         // "file:line" where known
};

struct ModuleRow {
  std::int64_t id = 0;
  std::string path;           // e.g. "block1.0.attn"
  std::string module_type;
  std::string source;
  // What its forward took, as first seen: one entry per positional argument, a dtype for
  // a tensor ("float16", "int64") or a Python type name; empty when unknown (format 1).
  std::string inputs;
};

struct StepRow {
  std::int64_t step = 0;
  double loss = 0.0;          // the sum of the step's losses; NaN when non-finite or none
  // How many losses were summed into `loss` (micro-batches, several losses): 0 when the
  // agent saw none, -1 when the file does not say (format 1: NULL meant NaN or unknown).
  std::int64_t losses = -1;
  double scale_before = 1.0;  // the loss scale the gradients were multiplied by
  double scale_after = 1.0;   // after update()
  bool found_inf = false;
  bool skipped = false;       // the optimizer step did not run
  bool sampled = false;       // per-layer statistics were recorded for this step
  std::int64_t step_ns = 0;   // wall time of the whole step, as the agent saw it
  std::int64_t agent_ns = 0;  // the agent's own cost within it
  double wall_time = 0.0;     // seconds since the Unix epoch
};

struct GradStatRow {
  std::int64_t step = 0;
  std::int64_t layer_id = 0;
  std::int64_t bwd_order = -1;  // arrival order in backward; -1 when no hook saw it
  StatValues stats;
  std::vector<std::uint32_t> histogram;  // empty, or kernels::kHistBins counts
};

struct ActStatRow {
  std::int64_t step = 0;
  std::int64_t module_id = 0;
  std::int64_t fwd_order = 0;   // order of the probe within the step's forwards (all micro-batches)
  std::int64_t micro_batch = 0; // which forward of the step (gradient accumulation), 0-based
  StatValues stats;
  std::vector<std::uint32_t> histogram;  // empty, or kHistBins counts (as GradStatRow's)
};

// One FP32 replay of a module whose output held NaN/Inf: the agent ran it again with
// autocast off on copies of the same inputs.
struct ReplayRow {
  std::int64_t step = -1;
  std::string module;           // module path
  // "finite": its FP32 output was finite (pinning it fixes the forward); "nonfinite": still
  // NaN/Inf in FP32 (it received NaN/Inf, or FP32 does not help); "intrinsic": NaN/Inf in
  // FP32 from finite inputs (it makes them in any precision: a -inf mask, or a bug);
  // "unconfirmed": the replay could not run or raised; `reason` says why. Never evidence
  // either way.
  std::string outcome;
  double fp32_absmax = 0.0;     // largest |x| of the FP32 output; NaN when not finite
  std::string reason;
};

// One precision check (Python agent): a module's output as it ran under autocast (or in
// half-precision parameters) compared with the same call run again in FP32, on copies of
// its inputs, module state and RNG. Only checks where both outputs were finite and FP32's
// was not all zero are recorded.
struct PrecisionCheckRow {
  std::int64_t step = -1;
  std::string module;        // module path
  std::string dtype;         // the output's dtype as it ran ("float16", "bfloat16", ...)
  std::int64_t numel = 0;    // values compared (> 0)
  double rel_error = 0.0;    // ||y - y_fp32|| / ||y_fp32|| over the whole output (L2)
  std::int64_t zeroed = 0;   // values exactly 0 as it ran where FP32's were not
  double fp32_absmax = 0.0;  // largest |x| of the FP32 output
};

// One layer's weights at the start of a step (the Python agent's weight sampler): what the
// step's forward used. Finite values only; a layer holding NaN/Inf gets no row.
struct WeightNormRow {
  std::int64_t step = 0;
  std::int64_t layer_id = 0;
  double l2 = 0.0;      // L2 norm of the parameter, >= 0
  double absmax = 0.0;  // largest |x|, >= 0
  bool values_valid() const;
};

// Device time from the profiler (CUPTI activity records) of one step, module, phase and
// kind of work, summed over the records; rows of one key add up as records arrive.
enum class GpuPhase : std::int32_t {
  kForward = 0,
  kBackward = 1,
  kUnscale = 2,    // the scaler's unscale, when torch does it (ampdiag's fused one is kAmpdiag)
  kOptimizer = 3,
  kAmpdiag = 4,    // ampdiag's own kernels and copies
  kOther = 5,      // the step's other work (loss, scaler update, code outside any module)
};
enum class GpuKind : std::int32_t {
  kFloat32 = 0,    // fp32 kernels (TF32 GEMMs included: they take fp32 tensors)
  kFloat16 = 1,
  kBFloat16 = 2,
  kOtherKernel = 3,  // kernels whose precision neither the name nor the module's dtype tells
  kMemcpy = 4,
};
constexpr std::int32_t kGpuPhaseCount = 6;
constexpr std::int32_t kGpuKindCount = 5;
const char* gpu_phase_name(GpuPhase phase);
const char* gpu_kind_name(GpuKind kind);

struct GpuTimeRow {
  std::int64_t step = 0;
  std::int64_t module_id = -1;  // -1: no module
  GpuPhase phase = GpuPhase::kOther;
  GpuKind kind = GpuKind::kOtherKernel;
  std::int64_t count = 0;       // kernels or copies
  std::int64_t ns = 0;          // their summed duration
};

// On a measured step of a run whose parameters are stored in half precision (fp16/bf16
// without FP32 master weights): of one layer's elements whose gradient was finite and not
// zero, how many the optimizer step left unchanged (their update was smaller than half a
// unit in the last place of the weight, so it rounded away).
struct WeightUpdateRow {
  std::int64_t step = 0;
  std::int64_t layer_id = 0;
  std::int64_t nonzero = 0;  // elements with a finite, non-zero gradient
  std::int64_t stalled = 0;  // of those, elements whose stored value did not change
  // What a measurement can give: 0 <= stalled <= nonzero.
  bool counts_valid() const { return nonzero >= 0 && stalled >= 0 && stalled <= nonzero; }
};

struct EventRow {
  std::int64_t step = -1;       // -1: not tied to a step
  std::string kind;             // e.g. "dropped", "warning", "error"
  std::string detail;
  double wall_time = 0.0;
};

}  // namespace ampdiag::rundb
