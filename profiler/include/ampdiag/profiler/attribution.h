// From activity records to gpu_time rows: each kernel and copy goes to the range (step,
// module, phase) whose external id its launch carried, and is summed by precision.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ampdiag/profiler/activity.h"
#include "ampdiag/rundb/rows.h"

namespace ampdiag::profiler {

struct Range {
  std::int64_t step = 0;
  std::int64_t module_id = -1;
  rundb::GpuPhase phase = rundb::GpuPhase::kOther;
  rundb::GpuKind hint = rundb::GpuKind::kOtherKernel;  // what the module computes in
};

// The ranges the agent opened, by external id. Thread-safe: the training thread opens,
// the writer thread looks up. Ranges older than kKeepSteps steps are forgotten.
class RangeTable {
 public:
  static constexpr std::int64_t kKeepSteps = 64;
  std::uint64_t open(const Range& range);  // the range's external id, >= 1
  bool find(std::uint64_t external_id, Range& out) const;
  std::size_t size() const;

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::uint64_t, Range> ranges_;
  std::uint64_t next_id_ = 1;
  std::int64_t newest_step_ = INT64_MIN;
};

// Not thread-safe: the writer thread owns it.
class Aggregator {
 public:
  explicit Aggregator(const RangeTable& ranges) : ranges_(ranges) {}

  // Attributes what it can; a record whose external correlation has not arrived yet waits
  // for the next batches (CUPTI delivers them in separate buffers).
  void add(ActivityBatch&& batch);
  // Once no more records will come: what still waits is attributed as launched outside any
  // range, to the step of the nearest earlier launch.
  void finish();
  // The sums since the last call, one row per (step, module, phase, kind).
  std::vector<rundb::GpuTimeRow> take_rows();

  // Records that could not be tied to any step (dropped, counted).
  std::int64_t unattributed() const { return unattributed_; }

 private:
  struct Waiting {
    bool kernel;
    KernelActivity k;
    CopyActivity c;
    int rounds = 0;
  };
  bool attribute(const Waiting& w, bool final);
  void sum(const Range& range, rundb::GpuKind kind, std::uint64_t start, std::uint64_t end);
  void remember_step(std::uint32_t correlation, std::int64_t step);

  const RangeTable& ranges_;
  std::unordered_map<std::uint32_t, std::uint64_t> external_of_;  // correlation -> external id
  std::map<std::uint32_t, std::int64_t> step_at_;                  // correlation -> step, recent ones
  std::vector<Waiting> waiting_;
  std::map<std::tuple<std::int64_t, std::int64_t, int, int>, std::pair<std::int64_t, std::int64_t>> sums_;
  std::int64_t unattributed_ = 0;
};

}  // namespace ampdiag::profiler
