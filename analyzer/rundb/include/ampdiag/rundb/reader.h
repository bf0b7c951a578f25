// Reads a run.db, also while it is being written. Refuses, with a one-line RunDbError,
// anything that is not a run.db of a format this build understands.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ampdiag/rundb/rows.h"

namespace ampdiag::rundb {

class Database;

class RunDbReader {
 public:
  explicit RunDbReader(const std::string& path);
  ~RunDbReader();
  RunDbReader(const RunDbReader&) = delete;
  RunDbReader& operator=(const RunDbReader&) = delete;

  int schema_version() const { return version_; }
  const std::string& path() const { return path_; }
  // True once the writer called finish(): the file is complete.
  bool finished();

  std::map<std::string, std::string> meta();
  // SQLite's quick_check: "ok", or what is damaged.
  std::string integrity_check();
  std::vector<LayerRow> layers();
  std::vector<ModuleRow> modules();
  std::vector<StepRow> steps();
  // Agent events other than replays.
  std::vector<EventRow> events();
  // FP32 replays (format 1 files: read from their events).
  std::vector<ReplayRow> replays();
  // Row by row, in (step, layer) order: a long run does not need to fit in memory.
  void for_each_grad_stat(const std::function<void(const GradStatRow&)>& visit);
  std::vector<GradStatRow> grad_stats();
  std::vector<ActStatRow> act_stats();

 private:
  std::string path_;
  std::unique_ptr<Database> db_;
  int version_ = 0;
};

}  // namespace ampdiag::rundb
