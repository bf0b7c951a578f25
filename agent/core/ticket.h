// Tickets: statistics that arrive after the call that asked for them. The CPU engine fills
// a step's statistics at once; the CUDA engine copies them to pinned memory asynchronously,
// so they land a step or more later. The step recorder keeps a step open until all its
// tickets have landed, then records it in step order; a ticket that never lands makes its
// step a counted drop. Tickets are polled on the training thread and never block it.
#pragma once

#include <cstdint>

#include "ampdiag/kernels/tensor_stats.h"
#include "record_queue.h"

namespace ampdiag::agent {

// What a landing ticket may write into its step.
class StepSink {
 public:
  virtual ~StepSink() = default;
  virtual void grad(std::int64_t layer, std::int64_t bwd_order, const kernels::TensorStats& s,
                    const std::uint64_t* histogram) = 0;
  virtual void act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s,
                   const std::uint64_t* histogram, std::int32_t micro_batch) = 0;
  // The step's outcome as the agent gave it at end_step(); a ticket may complete it (a loss
  // or a found_inf read back from the device).
  virtual StepOutcome& outcome() = 0;
};

class Ticket {
 public:
  virtual ~Ticket() = default;
  // Non-blocking: have the results landed?
  virtual bool ready() = 0;
  // Blocks until ready or `timeout_ms` passed; returns ready(). Only when the run closes.
  virtual bool wait(std::int64_t timeout_ms) = 0;
  // Writes the results into the step; called once, after ready() said true.
  virtual void land(StepSink& step) = 0;
  // Names the engine in the drop event ("cuda").
  virtual const char* engine() const = 0;
};

}  // namespace ampdiag::agent
