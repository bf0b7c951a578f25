// The torch-free half of the agent: stages one step's statistics, asks the sampling
// policy what to keep, and hands fixed-size records to the writer thread. Shared by the
// C++ Agent and the Python binding. Used from the training thread only.
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
  double loss = 0.0;  // NaN when unknown
  double scale_before = 1.0, scale_after = 1.0;
  bool found_inf = false, skipped = false;
  std::int64_t step_ns = 0, agent_ns = 0;
};

struct RecorderCounters {
  std::int64_t steps = 0, rows_written = 0, dropped = 0, write_errors = 0;
  std::string first_error;
};

class StepRecorder {
 public:
  // Takes an opened writer (opening it is where a bad path fails, on the caller's thread).
  StepRecorder(std::unique_ptr<rundb::RunDbWriter> writer, std::size_t queue_capacity, std::int64_t every,
               std::int64_t context_steps);
  ~StepRecorder();

  WriterThread& writer() { return *writer_; }
  std::int64_t step() const { return step_; }
  // Position of the next activation in this step's forward order.
  std::int32_t next_forward_order() { return fwd_order_++; }

  void stage_grad(std::int64_t layer, std::int64_t bwd_order, const kernels::TensorStats& s,
                  const std::uint64_t* histogram = nullptr);
  void stage_act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s);
  // Ends the step: records what the policy keeps and the step row; returns whether this
  // step's statistics were recorded.
  bool end_step(const StepOutcome& outcome);
  // Reports drops, finishes the run.db. Idempotent.
  void close();
  RecorderCounters counters() const;

 private:
  struct StagedStep {
    Record step_record{};
    std::vector<Record> stats;
  };
  void stage(RecordKind kind, std::int64_t id, std::int64_t order, const kernels::TensorStats& s,
             const std::uint64_t* histogram);
  void push(const Record& r);

  std::unique_ptr<WriterThread> writer_;
  SamplingPolicy policy_;
  StagedStep current_;
  std::deque<StagedStep> history_;  // recent unrecorded steps an overflow may still ask for
  std::vector<StagedStep> spare_;   // recycled buffers: no allocation once warm
  std::int64_t step_ = 0;
  std::int32_t fwd_order_ = 0;
  bool closed_ = false;
};

}  // namespace ampdiag::agent
