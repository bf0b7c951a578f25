// The torch-free half of the agent: stages one step's statistics, asks the sampling
// policy what to keep, and hands fixed-size records to the writer thread. Shared by the
// C++ Agent and the Python binding. Used from the training thread only.
//
// A step is one optimizer cycle. end_step() leaves the step pending until the next cycle
// begins (begin_step(), or the first statistics staged for it) or the recorder closes:
// an extra `scaler.update(new_scale)` after the cycle's update() then amends that step's
// scale (amend_scale_after) instead of counting as a step of its own.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "ampdiag/kernels/tensor_stats.h"
#include "ampdiag/rundb/writer.h"
#include "sampling.h"
#include "writer_thread.h"

namespace ampdiag::agent {

struct StepOutcome {
  double loss = 0.0;         // sum of the cycle's losses; NaN when non-finite or none
  std::int64_t losses = 0;   // how many losses were summed (0: none seen)
  double scale_before = 1.0, scale_after = 1.0;
  bool found_inf = false, skipped = false;
  std::int64_t step_ns = 0, agent_ns = 0;
};

struct RecorderCounters {
  std::int64_t steps = 0, rows_written = 0, dropped = 0, lost = 0, write_errors = 0;
  std::string first_error;
};

class StepRecorder {
 public:
  // Takes an opened writer (opening it is where a bad path fails, on the caller's thread).
  StepRecorder(std::unique_ptr<rundb::RunDbWriter> writer, std::size_t queue_capacity, std::int64_t every,
               std::int64_t context_steps);
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
  void stage_act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s, std::int32_t micro_batch = 0);
  // Ends the step; it stays pending (see above).
  void end_step(const StepOutcome& outcome);
  // An update() after the step ended changed the scale again: the pending step ends at
  // `scale_after`. Returns false when no step is pending (before the first step).
  bool amend_scale_after(double scale_after);
  // Reports drops, finishes the run.db. Idempotent.
  void close();
  RecorderCounters counters() const;

 private:
  struct StagedStep {
    Record step_record{};
    std::vector<Record> stats;
  };
  void stage(RecordKind kind, std::int64_t id, std::int64_t order, const kernels::TensorStats& s,
             const std::uint64_t* histogram, std::int32_t micro_batch);
  void push(const Record& r);
  void record_step(const StepOutcome& outcome, double wall_time);

  std::unique_ptr<WriterThread> writer_;
  SamplingPolicy policy_;
  StagedStep current_;
  std::deque<StagedStep> history_;  // recent unrecorded steps an overflow may still ask for
  std::vector<StagedStep> spare_;   // recycled buffers: no allocation once warm
  std::int64_t step_ = 0;
  std::int32_t fwd_order_ = 0;
  bool pending_ = false;
  StepOutcome pending_outcome_;
  double pending_wall_time_ = 0.0;
  bool closed_ = false;
};

}  // namespace ampdiag::agent
