// The run.db tables (documented in docs/FORMAT.md; keep the two in step).
#include "schema.h"

#include <string>

#include "ampdiag/rundb/schema.h"

namespace ampdiag::rundb {

namespace {

constexpr const char* kTables = R"sql(
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
  source TEXT NOT NULL
);
CREATE TABLE steps (
  step INTEGER PRIMARY KEY,
  loss REAL,
  scale_before REAL NOT NULL,
  scale_after REAL NOT NULL,
  found_inf INTEGER NOT NULL,
  skipped INTEGER NOT NULL,
  sampled INTEGER NOT NULL,
  step_ns INTEGER NOT NULL,
  agent_ns INTEGER NOT NULL,
  wall_time REAL NOT NULL
);
CREATE TABLE grad_stats (
  step INTEGER NOT NULL,
  layer_id INTEGER NOT NULL,
  bwd_order INTEGER NOT NULL,
  numel INTEGER NOT NULL,
  nan INTEGER NOT NULL,
  inf INTEGER NOT NULL,
  zeros INTEGER NOT NULL,
  fp16_subnormal INTEGER NOT NULL,
  absmax REAL NOT NULL,
  amin_nz REAL NOT NULL,
  l2 REAL NOT NULL,
  histogram BLOB,
  PRIMARY KEY (step, layer_id)
) WITHOUT ROWID;
CREATE TABLE act_stats (
  step INTEGER NOT NULL,
  fwd_order INTEGER NOT NULL,
  module_id INTEGER NOT NULL,
  numel INTEGER NOT NULL,
  nan INTEGER NOT NULL,
  inf INTEGER NOT NULL,
  zeros INTEGER NOT NULL,
  fp16_subnormal INTEGER NOT NULL,
  absmax REAL NOT NULL,
  amin_nz REAL NOT NULL,
  l2 REAL NOT NULL,
  PRIMARY KEY (step, fwd_order)
) WITHOUT ROWID;
CREATE TABLE events (
  id INTEGER PRIMARY KEY,
  step INTEGER NOT NULL,
  kind TEXT NOT NULL,
  detail TEXT NOT NULL,
  wall_time REAL NOT NULL
);
)sql";

}  // namespace

void create_schema(Database& db) {
  db.exec(("PRAGMA application_id = " + std::to_string(kApplicationId) + ";").c_str());
  db.exec("BEGIN;");
  db.exec(kTables);
  db.exec(("INSERT INTO meta VALUES ('schema_version', '" + std::to_string(kSchemaVersion) + "');").c_str());
  db.exec("COMMIT;");
}

}  // namespace ampdiag::rundb
