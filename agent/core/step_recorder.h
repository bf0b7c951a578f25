// Stages each step's statistics, waits for its tickets (ticket.h), asks the sampling policy
// what to keep, and hands fixed-size records to the writer thread, in step order. Used
// from the training thread only.
//
// A step is one optimizer cycle. end_step() leaves the step pending until the next cycle
// begins (begin_step(), or the first statistics staged for it) or the recorder closes:
// an extra `scaler.update(new_scale)` after the cycle's update() then amends that step's
// scale (amend_scale_after) instead of counting as a step of its own. A closed step then
// waits in the ledger until its tickets have landed; when more than `max_waiting` steps
// wait, the oldest is recorded without its late statistics and counted as dropped.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "ampdiag/kernels/tensor_stats.h"
#include "ampdiag/rundb/writer.h"
#include "sampling.h"
#include "ticket.h"
#include "writer_thread.h"

namespace ampdiag::agent {

struct RecorderCounters {
  std::int64_t steps = 0, rows_written = 0, dropped = 0, lost = 0, write_errors = 0;
  std::int64_t dropped_steps = 0;  // steps recorded without statistics whose ticket never landed
  std::string first_error;
};

struct RecorderOptions {
  std::size_t queue_capacity = 1 << 15;
  std::int64_t every = 1, context_steps = 2;
  std::int64_t max_waiting = 8;     // closed steps that may wait for tickets
  std::int64_t close_wait_ms = 2000;  // how long close() waits for the last tickets
};

class StepRecorder {
 public:
  // Takes an opened writer (opening it is where a bad path fails, on the caller's thread).
  StepRecorder(std::unique_ptr<rundb::RunDbWriter> writer, const RecorderOptions& options);
  ~StepRecorder();

  WriterThread& writer() { return *writer_; }
  // The step events belong to: the pending step until the next cycle begins.
  std::int64_t step() const { return step_; }
  // Steps ended so far, the pending one included.
  std::int64_t steps_seen() const { return step_ + (pending_ ? 1 : 0); }

  // The next cycle begins: records the pending step, if any. Idempotent.
  void begin_step();
  // Position of the next activation in this step's forward order (begins the step).
  std::int32_t next_forward_order() {
    begin_step();
    return fwd_order_++;
  }

  void stage_grad(std::int64_t layer, std::int64_t bwd_order, const kernels::TensorStats& s,
                  const std::uint64_t* histogram = nullptr);
  void stage_act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s,
                 const std::uint64_t* histogram = nullptr, std::int32_t micro_batch = 0);
  // Results of this step that land later.
  void stage_ticket(std::unique_ptr<Ticket> ticket);
  // Some of this step's statistics could not even be asked for (the engine had no free
  // slot): the step is recorded without them and counted as dropped.
  void mark_incomplete(const char* engine);
  // Ends the step; it stays pending (see above).
  void end_step(const StepOutcome& outcome);
  // An update() after the step ended changed the scale again: the pending step ends at
  // `scale_after`. Returns false when no step is pending (before the first step).
  bool amend_scale_after(double scale_after);
  // The same for a scale still on the device: the ticket joins the pending step.
  bool amend_ticket(std::unique_ptr<Ticket> ticket);
  bool pending() const { return pending_; }
  // Records the waiting steps whose tickets have landed. Cheap; begin_step() calls it.
  void settle();
  // Waits (bounded) for the last tickets, reports drops, finishes the run.db. Idempotent.
  void close();
  RecorderCounters counters() const;

 private:
  struct StagedStep {
    std::int64_t step = 0;
    StepOutcome outcome;
    double wall_time = 0.0;
    std::vector<Record> stats;
    std::vector<std::unique_ptr<Ticket>> tickets;
    const char* missing = nullptr;  // the engine whose statistics this step lacks
  };
  class Sink;
  static void add_stat(StagedStep& into, RecordKind kind, std::int64_t id, std::int64_t order,
                       const kernels::TensorStats& s, const std::uint64_t* histogram, std::int32_t micro_batch);
  static bool tickets_ready(StagedStep& s);
  void land_tickets(StagedStep& s);
  void drop_statistics(StagedStep& s);
  void count_drop(const StagedStep& s);
  void push(const Record& r);
  void record_step(StagedStep&& s);
  void keep_last_gradient_readings(std::vector<Record>& stats);
  StagedStep fresh_step();

  std::unique_ptr<WriterThread> writer_;
  SamplingPolicy policy_;
  RecorderOptions options_;
  StagedStep current_;
  std::deque<StagedStep> waiting_;  // closed steps whose tickets are not all in, in step order
  std::deque<StagedStep> history_;  // recent unrecorded steps an overflow may still ask for
  std::vector<StagedStep> spare_;   // recycled buffers: no allocation once warm
  std::int64_t step_ = 0;
  std::int32_t fwd_order_ = 0;
  bool pending_ = false;
  std::int64_t dropped_steps_ = 0;
  // keep_last_gradient_readings(): per layer id, the stamp of the step that last read it.
  std::vector<std::int64_t> grad_stamp_;
  std::int64_t stamp_ = 0;
  bool closed_ = false;
};

}  // namespace ampdiag::agent
