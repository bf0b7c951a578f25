// The bounded single-producer/single-consumer queue between the training thread and the
// writer thread: fixed-size records, no locks, no allocation; a full queue drops.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>

#include "ampdiag/kernels/tensor_stats.h"

namespace ampdiag::agent {

enum class RecordKind : std::uint8_t { kStep, kGrad, kAct };

// How an optimizer cycle ended, as the agent saw it.
struct StepOutcome {
  double loss = 0.0;         // sum of the cycle's losses; NaN when non-finite or none
  std::int64_t losses = 0;   // how many losses were summed (0: none seen)
  double scale_before = 1.0, scale_after = 1.0;
  bool found_inf = false, skipped = false;
  std::int64_t step_ns = 0, agent_ns = 0;
};

struct StepPayload {
  StepOutcome outcome;
  double wall_time;
  bool sampled;
};

struct StatPayload {
  std::int64_t id;     // layer id (kGrad) or module id (kAct)
  std::int64_t order;  // bwd_order or fwd_order
  std::int32_t micro_batch;  // kAct: which forward of the step
  kernels::TensorStats stats;
  bool has_histogram;
  std::uint32_t histogram[kernels::kHistBins];
};

// Not a union: TensorStats has default member initializers, which a union member may not.
struct Record {
  RecordKind kind = RecordKind::kStep;
  std::int64_t step = 0;
  StepPayload step_data{};  // kStep
  StatPayload stat{};       // kGrad, kAct
};
static_assert(sizeof(Record) <= 512, "records are copied on the training thread: keep them small");

class RecordQueue {
 public:
  explicit RecordQueue(std::size_t capacity) : capacity_(capacity), slots_(new Record[capacity]) {
    if (capacity < 2) throw std::invalid_argument("queue capacity must be at least 2 records");
  }

  // Training thread. False when full: the caller counts the drop.
  bool push(const Record& r) {
    const std::size_t head = head_.load(std::memory_order_relaxed);
    const std::size_t next = (head + 1) % capacity_;
    if (next == tail_.load(std::memory_order_acquire)) return false;
    slots_[head] = r;
    head_.store(next, std::memory_order_release);
    return true;
  }

  // Writer thread.
  bool pop(Record& out) {
    const std::size_t tail = tail_.load(std::memory_order_relaxed);
    if (tail == head_.load(std::memory_order_acquire)) return false;
    out = slots_[tail];
    tail_.store((tail + 1) % capacity_, std::memory_order_release);
    return true;
  }

  bool empty() const { return tail_.load(std::memory_order_acquire) == head_.load(std::memory_order_acquire); }
  // Records waiting; exact on either thread when the other is idle, else a snapshot.
  std::size_t size() const {
    const std::size_t head = head_.load(std::memory_order_acquire), tail = tail_.load(std::memory_order_acquire);
    return (head + capacity_ - tail) % capacity_;
  }

 private:
  const std::size_t capacity_;
  std::unique_ptr<Record[]> slots_;
  alignas(64) std::atomic<std::size_t> head_{0};
  alignas(64) std::atomic<std::size_t> tail_{0};
};

}  // namespace ampdiag::agent
