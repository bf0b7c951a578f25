// Writes a run.db: WAL mode (readable while it is written), rows batched into
// transactions that the owner commits. Single-threaded: the agent's writer thread owns it.
#pragma once

#include <memory>
#include <string>

#include "ampdiag/rundb/rows.h"

namespace ampdiag::rundb {

class Database;
class Statement;

class RunDbWriter {
 public:
  // Creates `path`. An existing file is an error unless `overwrite` is set, so a second
  // run never destroys the first by accident; a file another writer holds is an error even
  // then (the writer holds an exclusive lock on its file until it is destroyed). Throws
  // RunDbError naming the path and, where it can, the cause; a failed creation leaves no
  // file behind.
  RunDbWriter(const std::string& path, bool overwrite);
  ~RunDbWriter();  // commits what is pending; never throws
  RunDbWriter(const RunDbWriter&) = delete;
  RunDbWriter& operator=(const RunDbWriter&) = delete;

  void set_meta(const std::string& key, const std::string& value);
  void add_layer(const LayerRow& row);
  void add_module(const ModuleRow& row);
  void add_step(const StepRow& row);
  void add_grad_stat(const GradStatRow& row);
  void add_act_stat(const ActStatRow& row);
  void add_event(const EventRow& row);
  void add_replay(const ReplayRow& row);

  // Ends the current transaction (a later row starts the next one).
  void commit();
  // Abandons the current transaction, e.g. after a failed commit (disk full).
  void rollback() noexcept;
  // Marks the run finished (meta "finished_at"), commits and checkpoints the WAL.
  void finish();

  const std::string& path() const { return path_; }

 private:
  void begin_if_needed();
  void open_and_create();
  void close_all() noexcept;

  std::string path_;
  std::unique_ptr<Database> db_;
  std::unique_ptr<Statement> meta_, layer_, module_, step_, grad_, act_, event_, replay_;
  bool in_transaction_ = false;
  int lock_ = -1;  // the flock()ed descriptor of path_
};

}  // namespace ampdiag::rundb
