// The agent's writer thread: drains the record queue into the run.db in batched
// transactions. Everything slow (SQLite, strings, allocation) happens here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ampdiag/rundb/writer.h"
#include "record_queue.h"

namespace ampdiag::agent {

// Rows produced off the training thread that the writer pulls (the profiler's).
class GpuRowSource {
 public:
  virtual ~GpuRowSource() = default;
  // Replaces `rows` with what is ready; returns the records counted unattributable so far.
  virtual std::int64_t drain(std::vector<rundb::GpuTimeRow>& rows) = 0;
};

class WriterThread {
 public:
  // Takes the opened writer: opening happens on the caller's thread so that a bad path
  // fails at attach time, before training starts.
  WriterThread(std::unique_ptr<rundb::RunDbWriter> writer, std::size_t queue_capacity);
  ~WriterThread();  // = stop()

  // Training thread: queues a record; false when the queue is full (the caller counts the
  // drop). Wakes the writer early once the queue is a quarter full.
  bool push(const Record& r);
  const RecordQueue& queue() const { return queue_; }

  // Rare, string-carrying rows from any thread (layer/module definitions, events).
  void post_layer(rundb::LayerRow row);
  void post_module(rundb::ModuleRow row);
  void post_event(rundb::EventRow row);
  void post_replay(rundb::ReplayRow row);
  void post_precision_check(rundb::PrecisionCheckRow row);
  void post_weight_norm(rundb::WeightNormRow row);
  void post_weight_update(rundb::WeightUpdateRow row);
  void post_meta(std::string key, std::string value);
  // Pulled at every drain until stop(); the source must outlive stop().
  void set_gpu_source(GpuRowSource* source) { gpu_source_.store(source); }

  // Drains everything, marks the run finished and closes the file. Idempotent.
  void stop();

  // Records in committed transactions: what the file holds.
  std::int64_t rows_written() const { return rows_written_.load(); }
  // Records that never reached the file because writing failed (the failed transaction's
  // and every one after it).
  std::int64_t lost() const { return lost_.load(); }
  std::int64_t write_errors() const { return write_errors_.load(); }
  std::string first_error() const;
  // Records dropped because the queue was full (the writer fell behind).
  std::atomic<std::int64_t>& dropped() { return dropped_; }
  // Idle waits that a quarter-full queue ended before their time.
  std::int64_t early_wakes() const { return early_wakes_.load(); }

 private:
  void run();
  bool drain_once();
  void write(const Record& r);
  void commit();
  void record_failure() noexcept;
  void idle_wait();

  std::unique_ptr<rundb::RunDbWriter> writer_;
  RecordQueue queue_;
  std::mutex posted_mutex_;
  std::vector<rundb::LayerRow> layers_;
  std::vector<rundb::ModuleRow> modules_;
  std::vector<rundb::EventRow> events_;
  std::vector<rundb::ReplayRow> replays_;
  std::vector<rundb::PrecisionCheckRow> precision_checks_;
  std::vector<rundb::WeightNormRow> weight_norms_;
  std::vector<rundb::WeightUpdateRow> weight_updates_;
  std::vector<std::pair<std::string, std::string>> meta_;
  std::atomic<GpuRowSource*> gpu_source_{nullptr};
  std::vector<rundb::GpuTimeRow> gpu_rows_;  // writer thread only
  std::int64_t gpu_unattributed_ = 0;
  std::atomic<bool> stopping_{false};
  // The writer waits here between drains; see idle_wait().
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  std::atomic<bool> idle_{false};
  std::atomic<std::int64_t> early_wakes_{0};
  const std::size_t wake_at_;
  std::atomic<std::int64_t> rows_written_{0};
  std::atomic<std::int64_t> write_errors_{0};
  std::atomic<std::int64_t> dropped_{0};
  std::atomic<std::int64_t> lost_{0};
  std::int64_t uncommitted_ = 0;  // writer thread only
  std::int64_t dropped_reported_ = 0;
  mutable std::mutex error_mutex_;
  std::string first_error_;
  std::thread thread_;
  bool stopped_ = false;
};

}  // namespace ampdiag::agent
