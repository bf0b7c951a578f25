// StepRecorder; see step_recorder.h.
#include "step_recorder.h"

#include <algorithm>
#include <chrono>

namespace ampdiag::agent {

namespace {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

StepRecorder::StepRecorder(std::unique_ptr<rundb::RunDbWriter> writer, std::size_t queue_capacity, std::int64_t every,
                           std::int64_t context_steps)
    : policy_(every, context_steps) {
  if (queue_capacity < 16) throw std::invalid_argument("queue_capacity must be at least 16 records");
  writer_ = std::make_unique<WriterThread>(std::move(writer), queue_capacity + 1);
  current_.stats.reserve(1024);
}

StepRecorder::~StepRecorder() { close(); }

void StepRecorder::push(const Record& r) {
  if (!writer_->queue().push(r)) writer_->dropped().fetch_add(1, std::memory_order_relaxed);
}

void StepRecorder::stage(RecordKind kind, std::int64_t id, std::int64_t order, const kernels::TensorStats& s,
                         const std::uint64_t* histogram, std::int32_t micro_batch) {
  begin_step();
  Record r;
  r.kind = kind;
  r.step = step_;
  r.stat.id = id;
  r.stat.order = order;
  r.stat.micro_batch = micro_batch;
  r.stat.stats = s;
  r.stat.has_histogram = histogram != nullptr;
  if (histogram)
    for (int b = 0; b < kernels::kHistBins; ++b)
      r.stat.histogram[b] = std::uint32_t(std::min<std::uint64_t>(histogram[b], 0xffffffffu));
  current_.stats.push_back(r);
}

void StepRecorder::stage_grad(std::int64_t layer, std::int64_t bwd_order, const kernels::TensorStats& s,
                              const std::uint64_t* histogram) {
  stage(RecordKind::kGrad, layer, bwd_order, s, histogram, 0);
}

void StepRecorder::stage_act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s,
                             std::int32_t micro_batch) {
  stage(RecordKind::kAct, module, fwd_order, s, nullptr, micro_batch);
}

void StepRecorder::end_step(const StepOutcome& o) {
  begin_step();  // a cycle without statistics still ends the one before it
  pending_ = true;
  pending_outcome_ = o;
  pending_wall_time_ = unix_seconds();
}

bool StepRecorder::amend_scale_after(double scale_after) {
  if (!pending_) return false;
  pending_outcome_.scale_after = scale_after;
  return true;
}

void StepRecorder::begin_step() {
  if (!pending_) return;
  pending_ = false;
  record_step(pending_outcome_, pending_wall_time_);
}

void StepRecorder::record_step(const StepOutcome& o, double wall_time) {
  Record step_record;
  step_record.kind = RecordKind::kStep;
  step_record.step = step_;
  auto& d = step_record.step_data;
  d.loss = o.loss;
  d.losses = o.losses;
  d.scale_before = o.scale_before;
  d.scale_after = o.scale_after;
  d.found_inf = o.found_inf;
  d.skipped = o.skipped;
  d.wall_time = wall_time;
  d.step_ns = o.step_ns;
  d.agent_ns = o.agent_ns;

  const auto decision = policy_.decide(step_, o.found_inf, o.scale_after != o.scale_before);
  if (decision.record) {
    // Earlier unrecorded steps first, so rows arrive in step order.
    const std::size_t keep =
        history_.size() - std::min<std::size_t>(history_.size(), std::size_t(decision.flush_before));
    for (std::size_t h = keep; h < history_.size(); ++h) {
      StagedStep& old = history_[h];
      old.step_record.step_data.sampled = true;
      for (const auto& r : old.stats) push(r);
      push(old.step_record);
    }
    while (!history_.empty()) {
      spare_.push_back(std::move(history_.front()));
      history_.pop_front();
    }
  }
  d.sampled = decision.record;
  if (decision.record) {
    for (const auto& r : current_.stats) push(r);
    current_.stats.clear();
  } else if (policy_.context() > 0) {
    current_.step_record = step_record;
    history_.push_back(std::move(current_));
    if (std::int64_t(history_.size()) > policy_.context()) {
      spare_.push_back(std::move(history_.front()));
      history_.pop_front();
    }
    if (!spare_.empty()) {
      current_ = std::move(spare_.back());
      spare_.pop_back();
    } else {
      current_ = StagedStep();
    }
    current_.stats.clear();
  } else {
    current_.stats.clear();
  }
  push(step_record);
  ++step_;
  fwd_order_ = 0;
}

void StepRecorder::close() {
  if (closed_) return;
  begin_step();
  closed_ = true;
  const std::int64_t dropped = writer_->dropped().load();
  if (dropped > 0)
    writer_->post_event({step_, "dropped",
                         std::to_string(dropped) +
                             " records were dropped because the writer fell behind (raise queue_capacity or record "
                             "less often with every=N)",
                         0.0});
  writer_->post_meta("steps", std::to_string(step_));
  writer_->stop();
}

RecorderCounters StepRecorder::counters() const {
  RecorderCounters c;
  c.steps = steps_seen();
  c.rows_written = writer_->rows_written();
  c.dropped = writer_->dropped().load();
  c.lost = writer_->lost();
  c.write_errors = writer_->write_errors();
  c.first_error = writer_->first_error();
  return c;
}

}  // namespace ampdiag::agent
