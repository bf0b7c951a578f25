// WriterThread; see writer_thread.h.
#include "writer_thread.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace ampdiag::agent {

// run.db stores the kernels' histograms as they are; the format names the same bins.
static_assert(kernels::kHistBins == rundb::kHistBins && kernels::kHistMinExp == rundb::kHistMinExp &&
                  kernels::kHistMaxExp == rundb::kHistMaxExp,
              "the kernels' exponent histogram and run.db's disagree on the bins");

namespace {

// A commit every ~50 ms keeps readers current and bounds what a killed process loses.
constexpr auto kCommitEvery = std::chrono::milliseconds(50);
// The longest an idle writer waits for records. It used to poll every 2 ms: 500 wake-ups a
// second that took a core from the training thread's intra-op team, each stalling a
// parallel region (docs/PERFORMANCE.md, "The writer's wake-ups"). A quarter-full queue wakes
// it at once, so a fast producer does not wait on this.
constexpr auto kIdleWait = std::chrono::milliseconds(25);

rundb::StatValues to_values(const kernels::TensorStats& s) {
  return {s.numel, s.nan, s.inf, s.zeros, s.fp16_subnormal, double(s.absmax), double(s.amin_nz), s.l2};
}

}  // namespace

WriterThread::WriterThread(std::unique_ptr<rundb::RunDbWriter> writer, std::size_t queue_capacity)
    : writer_(std::move(writer)), queue_(queue_capacity), wake_at_(std::max<std::size_t>(1, queue_capacity / 4)) {
  thread_ = std::thread([this] { run(); });
}

bool WriterThread::push(const Record& r) {
  if (!queue_.push(r)) return false;
  // The mutex orders this wake after the writer's last look at the queue: no wake-up is lost.
  if (idle_.load(std::memory_order_acquire) && queue_.size() >= wake_at_) {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    wake_.notify_one();
  }
  return true;
}

void WriterThread::idle_wait() {
  std::unique_lock<std::mutex> lock(wake_mutex_);
  idle_.store(true, std::memory_order_release);
  const bool filled = wake_.wait_for(lock, kIdleWait, [this] {
    return stopping_.load(std::memory_order_acquire) || queue_.size() >= wake_at_;
  });
  idle_.store(false, std::memory_order_release);
  if (filled && !stopping_.load(std::memory_order_acquire)) early_wakes_.fetch_add(1, std::memory_order_relaxed);
}

WriterThread::~WriterThread() { stop(); }

void WriterThread::post_layer(rundb::LayerRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  layers_.push_back(std::move(row));
}

void WriterThread::post_module(rundb::ModuleRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  modules_.push_back(std::move(row));
}

void WriterThread::post_event(rundb::EventRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  events_.push_back(std::move(row));
}

void WriterThread::post_replay(rundb::ReplayRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  replays_.push_back(std::move(row));
}

void WriterThread::post_precision_check(rundb::PrecisionCheckRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  precision_checks_.push_back(std::move(row));
}

void WriterThread::post_weight_norm(rundb::WeightNormRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  weight_norms_.push_back(row);
}

void WriterThread::post_weight_update(rundb::WeightUpdateRow row) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  weight_updates_.push_back(row);
}

void WriterThread::post_meta(std::string key, std::string value) {
  std::lock_guard<std::mutex> lock(posted_mutex_);
  meta_.emplace_back(std::move(key), std::move(value));
}

std::string WriterThread::first_error() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return first_error_;
}

void WriterThread::write(const Record& r) {
  // Counted as written only once its transaction commits; lost with it if it fails (this
  // record included, should its own insert be what fails).
  ++uncommitted_;
  if (r.kind == RecordKind::kStep) {
    rundb::StepRow row;
    row.step = r.step;
    const StepOutcome& o = r.step_data.outcome;
    row.loss = o.loss;
    row.losses = o.losses;
    row.scale_before = o.scale_before;
    row.scale_after = o.scale_after;
    row.found_inf = o.found_inf;
    row.skipped = o.skipped;
    row.sampled = r.step_data.sampled;
    row.step_ns = o.step_ns;
    row.agent_ns = o.agent_ns;
    row.wall_time = r.step_data.wall_time;
    writer_->add_step(row);
  } else if (r.kind == RecordKind::kGrad) {
    rundb::GradStatRow row;
    row.step = r.step;
    row.layer_id = r.stat.id;
    row.bwd_order = r.stat.order;
    row.stats = to_values(r.stat.stats);
    if (r.stat.has_histogram) row.histogram.assign(r.stat.histogram, r.stat.histogram + kernels::kHistBins);
    writer_->add_grad_stat(row);
  } else {
    rundb::ActStatRow row;
    row.step = r.step;
    row.module_id = r.stat.id;
    row.fwd_order = r.stat.order;
    row.micro_batch = r.stat.micro_batch;
    row.stats = to_values(r.stat.stats);
    if (r.stat.has_histogram) row.histogram.assign(r.stat.histogram, r.stat.histogram + kernels::kHistBins);
    writer_->add_act_stat(row);
  }
}

void WriterThread::commit() {
  writer_->commit();
  rows_written_.fetch_add(uncommitted_, std::memory_order_relaxed);
  uncommitted_ = 0;
}

// One pass: posted rows, then queued records. Returns whether anything was written.
bool WriterThread::drain_once() {
  std::vector<rundb::LayerRow> layers;
  std::vector<rundb::ModuleRow> modules;
  std::vector<rundb::EventRow> events;
  std::vector<rundb::ReplayRow> replays;
  std::vector<rundb::PrecisionCheckRow> precision_checks;
  std::vector<rundb::WeightNormRow> weight_norms;
  std::vector<rundb::WeightUpdateRow> weight_updates;
  std::vector<std::pair<std::string, std::string>> meta;
  {
    std::lock_guard<std::mutex> lock(posted_mutex_);
    layers.swap(layers_);
    modules.swap(modules_);
    events.swap(events_);
    replays.swap(replays_);
    precision_checks.swap(precision_checks_);
    weight_norms.swap(weight_norms_);
    weight_updates.swap(weight_updates_);
    meta.swap(meta_);
  }
  bool any = !(layers.empty() && modules.empty() && events.empty() && replays.empty() && meta.empty() &&
               weight_updates.empty() && precision_checks.empty() && weight_norms.empty());
  for (const auto& [k, v] : meta) writer_->set_meta(k, v);
  for (const auto& row : layers) writer_->add_layer(row);
  for (const auto& row : modules) writer_->add_module(row);
  for (const auto& row : events) writer_->add_event(row);
  for (const auto& row : replays) writer_->add_replay(row);
  for (const auto& row : precision_checks) writer_->add_precision_check(row);
  for (const auto& row : weight_norms) writer_->add_weight_norm(row);
  for (const auto& row : weight_updates) writer_->add_weight_update(row);
  const std::int64_t dropped = dropped_.load(std::memory_order_relaxed);
  if (dropped != dropped_reported_) {
    writer_->set_meta("dropped_records", std::to_string(dropped));
    dropped_reported_ = dropped;
    any = true;
  }
  if (GpuRowSource* gpu = gpu_source_.load()) {
    const std::int64_t unattributed = gpu->drain(gpu_rows_);
    for (const auto& row : gpu_rows_) writer_->add_gpu_time(row);
    any = any || !gpu_rows_.empty();
    if (unattributed != gpu_unattributed_) {
      writer_->set_meta("gpu_unattributed_records", std::to_string(unattributed));
      gpu_unattributed_ = unattributed;
    }
  }
  Record r;
  for (int n = 0; n < 100000 && queue_.pop(r); ++n) {
    write(r);
    any = true;
  }
  return any;
}

void WriterThread::run() {
  auto last_commit = std::chrono::steady_clock::now();
  bool failed = false;
  for (;;) {
    const bool stopping = stopping_.load(std::memory_order_acquire);
    if (!failed) {
      try {
        const bool wrote = drain_once();
        const auto now = std::chrono::steady_clock::now();
        if (now - last_commit >= kCommitEvery || stopping) {
          commit();
          last_commit = now;
        }
        if (stopping && queue_.empty()) {
          drain_once();
          commit();
          writer_->finish();
          return;
        }
        if (!wrote) idle_wait();
        continue;
      } catch (const std::exception& e) {
        // Training goes on: log once, then count what can no longer be written. The rows of
        // the failed transaction never reached the file.
        failed = true;
        write_errors_.fetch_add(1);
        writer_->rollback();
        lost_.fetch_add(uncommitted_, std::memory_order_relaxed);
        uncommitted_ = 0;
        std::lock_guard<std::mutex> lock(error_mutex_);
        first_error_ = e.what();
        std::fprintf(stderr, "ampdiag: writing %s failed, no more records will be written (training goes on): %s\n",
                     writer_->path().c_str(), e.what());
      }
    }
    Record r;
    while (queue_.pop(r)) lost_.fetch_add(1, std::memory_order_relaxed);
    if (stopping) {
      record_failure();
      return;
    }
    idle_wait();
  }
}

void WriterThread::record_failure() noexcept {
  // One last try, once training is over: space may have been freed since. The file then
  // says why it is incomplete, and the report shows it.
  try {
    writer_->set_meta("write_error", first_error());
    writer_->set_meta("lost_records", std::to_string(lost_.load()));
    writer_->commit();
  } catch (const std::exception&) {
    writer_->rollback();
  }
}

void WriterThread::stop() {
  if (stopped_) return;
  stopped_ = true;
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  writer_.reset();
}

}  // namespace ampdiag::agent
