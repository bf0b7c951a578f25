// The session's side of device profiling: the activity source (CUPTI), the ranges the
// adapters open around modules and phases, and the aggregation into gpu_time rows, which
// runs on the writer thread (WriterThread pulls them), never on the training thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ampdiag/profiler/activity.h"
#include "ampdiag/profiler/attribution.h"
#include "writer_thread.h"

namespace ampdiag::agent {

class ProfileCollector final : public GpuRowSource {
 public:
  explicit ProfileCollector(std::unique_ptr<profiler::ActivitySource> source);
  ~ProfileCollector() override;

  // "" or why profiling is unavailable (the collector is then unusable).
  std::string start();
  std::string source_name() const { return source_->name(); }

  // --- the training thread -----------------------------------------------------------
  // A cycle begins: records kernels and copies only for steps that are recorded.
  void begin_step(std::int64_t step, bool record);
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  // Any launching thread (autograd's too): what it launches until end_range() belongs to
  // `module` in `phase` of the current step. Returns whether a range was opened.
  bool begin_range(std::int64_t module, rundb::GpuPhase phase, rundb::GpuKind hint);
  void end_range();
  // Before the writer's last drain: stops recording and completes CUPTI's buffers.
  void stop();

  // --- the writer thread ---------------------------------------------------------------
  std::int64_t drain(std::vector<rundb::GpuTimeRow>& rows) override;

 private:
  std::unique_ptr<profiler::ActivitySource> source_;
  profiler::RangeTable ranges_;
  std::atomic<std::int64_t> step_{0};
  std::atomic<bool> recording_{false};
  bool started_ = false;

  std::mutex drain_mutex_;  // the aggregator and what follows
  profiler::Aggregator aggregator_{ranges_};
  bool stopped_ = false, finished_ = false;
};

}  // namespace ampdiag::agent
