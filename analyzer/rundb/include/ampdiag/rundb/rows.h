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

// The statistics of one tensor (kernels::TensorStats, without depending on kernels).
struct StatValues {
  std::int64_t numel = 0, nan = 0, inf = 0, zeros = 0, fp16_subnormal = 0;
  double absmax = 0.0, amin_nz = 0.0, l2 = 0.0;
};

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
};

struct StepRow {
  std::int64_t step = 0;
  double loss = 0.0;          // NaN when not reported
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
  std::int64_t fwd_order = 0;   // order of the probe within the step's forward
  StatValues stats;
};

struct EventRow {
  std::int64_t step = -1;       // -1: not tied to a step
  std::string kind;             // e.g. "dropped", "warning", "error"
  std::string detail;
  double wall_time = 0.0;
};

}  // namespace ampdiag::rundb
