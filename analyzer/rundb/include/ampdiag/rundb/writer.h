// Writes a run.db: WAL mode (readable while it is written), rows batched into
// transactions that the owner commits. Single-threaded: the agent's writer thread owns it.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "ampdiag/rundb/rows.h"
#include "ampdiag/rundb/samples.h"

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
  // Also packs the row into the step's summary (grad_samples), written at the commit.
  // Throws for a layer id outside 0..2^32-1 (no run.db holds one).
  void add_grad_stat(const GradStatRow& row);
  void add_act_stat(const ActStatRow& row);
  void add_event(const EventRow& row);
  void add_replay(const ReplayRow& row);
  // Throws std::invalid_argument for a row the reader would refuse (see PrecisionCheckRow).
  void add_precision_check(const PrecisionCheckRow& row);
  // Throws std::invalid_argument for values no norm has (WeightNormRow::values_valid).
  void add_weight_norm(const WeightNormRow& row);
  // Adds to the row of the same (step, module, phase, kind) if there is one.
  void add_gpu_time(const GpuTimeRow& row);
  // Throws std::invalid_argument for counts no measurement gives (stalled > nonzero, < 0).
  void add_weight_update(const WeightUpdateRow& row);

  // Ends the current transaction (a later row starts the next one), with the summaries of
  // its gradient rows, so that a reader never sees one without the other.
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
  void add_histogram(const GradStatRow& row);
  void write_summaries(bool finishing);
  void commit_transaction(bool finishing);

  using HistogramSum = std::array<std::uint64_t, kHistBins>;
  // Per-layer sums of finite rows' histograms, in grad_hist_sums: a reader takes the sums
  // through their last_step and adds up grad_stats' histograms after it itself. `open`
  // gathers rows; once it holds kHistogramFlushRows and a later step begins, it moves to
  // `ready`, which the next commit writes.
  struct HistogramSums {
    std::unordered_map<std::int64_t, HistogramSum> by_layer;
    std::int64_t last_step = -1, rows = 0;
    void add(const HistogramSums& other);
  };

  std::string path_;
  std::unique_ptr<Database> db_;
  std::unique_ptr<Statement> meta_, layer_, module_, step_, grad_, act_, event_, replay_, precision_, weight_norms_, samples_, hist_sums_, gpu_,
      weights_;
  std::map<std::int64_t, std::vector<SampleRecord>> pending_samples_;  // the open transaction's, by step
  std::pair<const std::int64_t, std::vector<SampleRecord>>* pending_step_ = nullptr;  // the last row's
  HistogramSums hist_open_, hist_ready_;
  bool hist_broken_ = false;  // a transaction was rolled back
  bool in_transaction_ = false;
  int lock_ = -1;  // the flock()ed descriptor of path_
};

}  // namespace ampdiag::rundb
