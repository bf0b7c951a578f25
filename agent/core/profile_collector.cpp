// ProfileCollector; see profile_collector.h.
#include "profile_collector.h"

namespace ampdiag::agent {

ProfileCollector::ProfileCollector(std::unique_ptr<profiler::ActivitySource> source) : source_(std::move(source)) {}

ProfileCollector::~ProfileCollector() { stop(); }

std::string ProfileCollector::start() {
  std::string why = source_->start();
  started_ = why.empty();
  return why;
}

void ProfileCollector::begin_step(std::int64_t step, bool record) {
  if (!started_) return;
  step_.store(step, std::memory_order_relaxed);
  if (record != recording_.load(std::memory_order_relaxed)) {
    source_->set_recording(record);
    recording_.store(record, std::memory_order_relaxed);
  }
}

bool ProfileCollector::begin_range(std::int64_t module, rundb::GpuPhase phase, rundb::GpuKind hint) {
  if (!started_ || !recording()) return false;
  source_->push_range(ranges_.open({step_.load(std::memory_order_relaxed), module, phase, hint}));
  return true;
}

void ProfileCollector::end_range() { source_->pop_range(); }

void ProfileCollector::stop() {
  if (!started_) return;
  started_ = false;
  recording_.store(false, std::memory_order_relaxed);
  source_->stop();
  std::lock_guard<std::mutex> lock(drain_mutex_);
  stopped_ = true;
}

std::int64_t ProfileCollector::drain(std::vector<rundb::GpuTimeRow>& rows) {
  std::lock_guard<std::mutex> lock(drain_mutex_);
  profiler::ActivityBatch batch;
  source_->collect(batch);
  if (!batch.empty()) aggregator_.add(std::move(batch));
  if (stopped_ && !finished_) {
    aggregator_.finish();
    finished_ = true;
  }
  rows = aggregator_.take_rows();
  return aggregator_.unattributed();
}

}  // namespace ampdiag::agent
