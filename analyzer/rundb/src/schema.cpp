// The run.db tables (documented in docs/FORMAT.md; keep the two in step).
#include "schema.h"

#include <cmath>
#include <string>

#include "ampdiag/rundb/rows.h"
#include "ampdiag/rundb/schema.h"

namespace ampdiag::rundb {

namespace {

constexpr const char* kTablesBeforeStats = R"sql(
CREATE TABLE meta (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE layers (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL UNIQUE,
  module_path TEXT NOT NULL,
  module_type TEXT NOT NULL,
  dtype TEXT NOT NULL,
  shape TEXT NOT NULL,
  numel INTEGER NOT NULL,
  trainable INTEGER NOT NULL,
  source TEXT NOT NULL
);
CREATE TABLE modules (
  id INTEGER PRIMARY KEY,
  path TEXT NOT NULL UNIQUE,
  module_type TEXT NOT NULL,
  source TEXT NOT NULL,
  inputs TEXT NOT NULL DEFAULT ''
);
CREATE TABLE steps (
  step INTEGER PRIMARY KEY,
  loss REAL,
  losses INTEGER NOT NULL,
  scale_before REAL NOT NULL,
  scale_after REAL NOT NULL,
  found_inf INTEGER NOT NULL,
  skipped INTEGER NOT NULL,
  sampled INTEGER NOT NULL,
  step_ns INTEGER NOT NULL,
  agent_ns INTEGER NOT NULL,
  wall_time REAL NOT NULL
);
CREATE TABLE events (
  id INTEGER PRIMARY KEY,
  step INTEGER NOT NULL,
  kind TEXT NOT NULL,
  detail TEXT NOT NULL,
  wall_time REAL NOT NULL
);
CREATE TABLE replays (
  id INTEGER PRIMARY KEY,
  step INTEGER NOT NULL,
  module TEXT NOT NULL,
  outcome TEXT NOT NULL CHECK (outcome IN ('finite', 'nonfinite', 'intrinsic', 'unconfirmed')),
  fp32_absmax REAL,
  reason TEXT NOT NULL
);
CREATE TABLE precision_checks (
  id INTEGER PRIMARY KEY,
  step INTEGER NOT NULL,
  module TEXT NOT NULL,
  dtype TEXT NOT NULL,
  numel INTEGER NOT NULL,
  rel_error REAL NOT NULL,
  zeroed INTEGER NOT NULL,
  fp32_absmax REAL NOT NULL
);
CREATE TABLE weight_norms (
  step INTEGER NOT NULL,
  layer_id INTEGER NOT NULL,
  l2 REAL NOT NULL,
  absmax REAL NOT NULL,
  PRIMARY KEY (step, layer_id)
) WITHOUT ROWID;
CREATE TABLE grad_samples (
  id INTEGER PRIMARY KEY,
  step INTEGER NOT NULL,
  samples BLOB NOT NULL
);
CREATE TABLE gpu_time (
  step INTEGER NOT NULL,
  module_id INTEGER NOT NULL,
  phase INTEGER NOT NULL,
  kind INTEGER NOT NULL,
  count INTEGER NOT NULL,
  ns INTEGER NOT NULL,
  PRIMARY KEY (step, module_id, phase, kind)
) WITHOUT ROWID;
CREATE TABLE weight_updates (
  step INTEGER NOT NULL,
  layer_id INTEGER NOT NULL,
  nonzero INTEGER NOT NULL,
  stalled INTEGER NOT NULL,
  PRIMARY KEY (step, layer_id)
) WITHOUT ROWID;
CREATE TABLE grad_hist_sums (
  id INTEGER PRIMARY KEY,
  last_step INTEGER NOT NULL,
  layer_id INTEGER NOT NULL,
  counts BLOB NOT NULL
);
)sql";

std::string stat_columns() {
  std::string s;
  for (const auto& f : kStatFields) s += std::string("  ") + f.name + (f.count ? " INTEGER NOT NULL,\n" : " REAL NOT NULL,\n");
  return s;
}

}  // namespace

bool WeightNormRow::values_valid() const {
  return layer_id >= 0 && std::isfinite(l2) && l2 >= 0 && std::isfinite(absmax) && absmax >= 0 && absmax <= l2 * 1.000001;
}

const char* gpu_phase_name(GpuPhase phase) {
  switch (phase) {
    case GpuPhase::kForward: return "forward";
    case GpuPhase::kBackward: return "backward";
    case GpuPhase::kUnscale: return "unscale";
    case GpuPhase::kOptimizer: return "optimizer";
    case GpuPhase::kAmpdiag: return "ampdiag";
    case GpuPhase::kOther: break;
  }
  return "other";
}

const char* gpu_kind_name(GpuKind kind) {
  switch (kind) {
    case GpuKind::kFloat32: return "fp32";
    case GpuKind::kFloat16: return "fp16";
    case GpuKind::kBFloat16: return "bf16";
    case GpuKind::kMemcpy: return "memcpy";
    case GpuKind::kOtherKernel: break;
  }
  return "other";
}

std::string stat_column_list() {
  std::string s;
  for (const auto& f : kStatFields) s += std::string(s.empty() ? "" : ", ") + f.name;
  return s;
}

void create_schema(Database& db) {
  db.exec(("PRAGMA application_id = " + std::to_string(kApplicationId) + ";").c_str());
  db.exec("BEGIN;");
  db.exec(kTablesBeforeStats);
  db.exec(("CREATE TABLE grad_stats (\n  step INTEGER NOT NULL,\n  layer_id INTEGER NOT NULL,\n"
           "  bwd_order INTEGER NOT NULL,\n" +
           stat_columns() + "  histogram BLOB,\n  PRIMARY KEY (step, layer_id)\n) WITHOUT ROWID;")
              .c_str());
  db.exec(("CREATE TABLE act_stats (\n  step INTEGER NOT NULL,\n  fwd_order INTEGER NOT NULL,\n"
           "  module_id INTEGER NOT NULL,\n  micro_batch INTEGER NOT NULL,\n" +
           stat_columns() + "  histogram BLOB,\n  PRIMARY KEY (step, fwd_order)\n) WITHOUT ROWID;")
              .c_str());
  db.exec(("INSERT INTO meta VALUES ('schema_version', '" + std::to_string(kSchemaVersion) + "');").c_str());
  db.exec("COMMIT;");
}

}  // namespace ampdiag::rundb
