// StepRecorder; see step_recorder.h.
#include "step_recorder.h"

#include <algorithm>
#include <chrono>

namespace ampdiag::agent {

namespace {

using Clock = std::chrono::steady_clock;

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Drop events name the first few steps; the count covers all of them.
constexpr std::int64_t kDropEventsNamed = 10;

}  // namespace

// What a landing ticket writes into: its own step, whatever step is being staged now.
class StepRecorder::Sink final : public StepSink {
 public:
  explicit Sink(StagedStep& step) : step_(step) {}
  void grad(std::int64_t layer, std::int64_t bwd_order, const kernels::TensorStats& s,
            const std::uint64_t* histogram) override {
    add_stat(step_, RecordKind::kGrad, layer, bwd_order, s, histogram, 0);
  }
  void act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s, const std::uint64_t* histogram,
           std::int32_t micro_batch) override {
    add_stat(step_, RecordKind::kAct, module, fwd_order, s, histogram, micro_batch);
  }
  StepOutcome& outcome() override { return step_.outcome; }

 private:
  StagedStep& step_;
};

StepRecorder::StepRecorder(std::unique_ptr<rundb::RunDbWriter> writer, const RecorderOptions& options)
    : policy_(options.every, options.context_steps), options_(options) {
  if (options.queue_capacity < 16) throw std::invalid_argument("queue_capacity must be at least 16 records");
  if (options.max_waiting < 1) throw std::invalid_argument("max_waiting must be at least 1 step");
  writer_ = std::make_unique<WriterThread>(std::move(writer), options.queue_capacity + 1);
  current_.stats.reserve(1024);
}

StepRecorder::~StepRecorder() { close(); }

void StepRecorder::push(const Record& r) {
  if (!writer_->push(r)) writer_->dropped().fetch_add(1, std::memory_order_relaxed);
}

void StepRecorder::add_stat(StagedStep& into, RecordKind kind, std::int64_t id, std::int64_t order,
                            const kernels::TensorStats& s, const std::uint64_t* histogram, std::int32_t micro_batch) {
  Record r;
  r.kind = kind;
  r.step = into.step;
  r.stat.id = id;
  r.stat.order = order;
  r.stat.micro_batch = micro_batch;
  r.stat.stats = s;
  r.stat.has_histogram = histogram != nullptr;
  if (histogram)
    for (int b = 0; b < kernels::kHistBins; ++b)
      r.stat.histogram[b] = std::uint32_t(std::min<std::uint64_t>(histogram[b], 0xffffffffu));
  into.stats.push_back(r);
}

void StepRecorder::stage_grad(std::int64_t layer, std::int64_t bwd_order, const kernels::TensorStats& s,
                              const std::uint64_t* histogram) {
  begin_step();
  add_stat(current_, RecordKind::kGrad, layer, bwd_order, s, histogram, 0);
}

void StepRecorder::stage_act(std::int64_t module, std::int64_t fwd_order, const kernels::TensorStats& s,
                             const std::uint64_t* histogram, std::int32_t micro_batch) {
  begin_step();
  add_stat(current_, RecordKind::kAct, module, fwd_order, s, histogram, micro_batch);
}

void StepRecorder::stage_ticket(std::unique_ptr<Ticket> ticket) {
  begin_step();
  current_.tickets.push_back(std::move(ticket));
}

void StepRecorder::mark_incomplete(const char* engine) {
  begin_step();
  current_.missing = engine;
}

void StepRecorder::end_step(const StepOutcome& o) {
  begin_step();  // a cycle without statistics still ends the one before it
  pending_ = true;
  current_.outcome = o;
  current_.wall_time = unix_seconds();
}

bool StepRecorder::amend_scale_after(double scale_after) {
  if (!pending_) return false;
  current_.outcome.scale_after = scale_after;
  return true;
}

bool StepRecorder::amend_ticket(std::unique_ptr<Ticket> ticket) {
  if (!pending_) return false;
  current_.tickets.push_back(std::move(ticket));
  return true;
}

StepRecorder::StagedStep StepRecorder::fresh_step() {
  StagedStep s;
  if (!spare_.empty()) {
    s = std::move(spare_.back());
    spare_.pop_back();
  }
  s.stats.clear();
  s.tickets.clear();
  s.missing = nullptr;
  s.step = step_;
  s.outcome = StepOutcome();
  return s;
}

void StepRecorder::begin_step() {
  if (!pending_) return;
  pending_ = false;
  waiting_.push_back(std::move(current_));
  ++step_;
  fwd_order_ = 0;
  current_ = fresh_step();
  settle();
}

bool StepRecorder::tickets_ready(StagedStep& s) {
  for (auto& t : s.tickets)
    if (!t->ready()) return false;
  return true;
}

void StepRecorder::land_tickets(StagedStep& s) {
  Sink sink(s);
  for (auto& t : s.tickets) t->land(sink);
  s.tickets.clear();
}

void StepRecorder::drop_statistics(StagedStep& s) {
  Sink sink(s);
  for (auto& t : s.tickets) {
    if (t->ready())
      t->land(sink);
    else
      s.missing = t->engine();
  }
  s.tickets.clear();
}

void StepRecorder::count_drop(const StagedStep& s) {
  if (++dropped_steps_ <= kDropEventsNamed)
    writer_->post_event({s.step, "stats-dropped",
                         "statistics of step " + std::to_string(s.step) + " from the " + s.missing +
                             " engine never arrived; the step is recorded without them",
                         0.0});
}

void StepRecorder::settle() {
  while (!waiting_.empty()) {
    StagedStep& front = waiting_.front();
    if (tickets_ready(front))
      land_tickets(front);
    else if (std::int64_t(waiting_.size()) > options_.max_waiting)
      drop_statistics(front);
    else
      break;
    if (front.missing) count_drop(front);
    StagedStep done = std::move(front);
    waiting_.pop_front();
    record_step(std::move(done));
  }
}

namespace {

Record step_record(std::int64_t step, const StepOutcome& o, double wall_time, bool sampled) {
  Record r;
  r.kind = RecordKind::kStep;
  r.step = step;
  r.step_data = {o, wall_time, sampled};
  return r;
}

}  // namespace

// A gradient read twice in one step (two hooks on one optimizer, as a framework's wrapper
// made): its later reading stands. A second row would be refused by the run.db's key on
// (step, layer), and a refused write stops the recording for the rest of the run.
void StepRecorder::keep_last_gradient_readings(std::vector<Record>& stats) {
  ++stamp_;
  bool twice = false;
  for (const auto& r : stats) {
    if (r.kind != RecordKind::kGrad || r.stat.id < 0) continue;
    const auto id = std::size_t(r.stat.id);
    if (id >= grad_stamp_.size()) grad_stamp_.resize(id + 1, 0);
    twice = twice || grad_stamp_[id] == stamp_;
    grad_stamp_[id] = stamp_;
  }
  if (!twice) return;
  ++stamp_;  // walking back, the first reading met of a layer is its last
  std::vector<Record> kept;
  kept.reserve(stats.size());
  for (auto it = stats.rbegin(); it != stats.rend(); ++it) {
    if (it->kind == RecordKind::kGrad && it->stat.id >= 0) {
      auto& seen = grad_stamp_[std::size_t(it->stat.id)];
      if (seen == stamp_) continue;
      seen = stamp_;
    }
    kept.push_back(*it);
  }
  std::reverse(kept.begin(), kept.end());
  stats.swap(kept);
}

void StepRecorder::record_step(StagedStep&& s) {
  keep_last_gradient_readings(s.stats);
  const StepOutcome& o = s.outcome;
  const auto decision = policy_.decide(s.step, o.found_inf, o.scale_after != o.scale_before);
  if (decision.record) {
    // Earlier unrecorded steps first, so rows arrive in step order.
    const std::size_t keep =
        history_.size() - std::min<std::size_t>(history_.size(), std::size_t(decision.flush_before));
    for (std::size_t h = keep; h < history_.size(); ++h) {
      StagedStep& old = history_[h];
      for (const auto& r : old.stats) push(r);
      push(step_record(old.step, old.outcome, old.wall_time, true));
    }
    while (!history_.empty()) {
      spare_.push_back(std::move(history_.front()));
      history_.pop_front();
    }
    for (const auto& r : s.stats) push(r);
  }
  // Unrecorded steps stay in history (their rows go out as "sampled" if an overflow asks).
  push(step_record(s.step, o, s.wall_time, decision.record));
  if (!decision.record && policy_.context() > 0) {
    history_.push_back(std::move(s));
    if (std::int64_t(history_.size()) > policy_.context()) {
      spare_.push_back(std::move(history_.front()));
      history_.pop_front();
    }
  } else {
    spare_.push_back(std::move(s));
  }
}

void StepRecorder::close() {
  if (closed_) return;
  begin_step();
  closed_ = true;
  // The last steps' tickets get a bounded wait; what has not landed by then is dropped.
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.close_wait_ms);
  for (auto& s : waiting_)
    for (auto& t : s.tickets) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left > 0) t->wait(left);
    }
  options_.max_waiting = 0;  // everything still waiting goes now, landed or dropped
  settle();
  const std::int64_t dropped = writer_->dropped().load();
  if (dropped > 0)
    writer_->post_event({step_, "dropped",
                         std::to_string(dropped) +
                             " records were dropped because the writer fell behind (raise queue_capacity or record "
                             "less often with every=N)",
                         0.0});
  if (dropped_steps_ > 0)
    writer_->post_event({step_, "stats-dropped",
                         std::to_string(dropped_steps_) +
                             " steps are recorded without statistics that never arrived from the device",
                         0.0});
  writer_->post_meta("steps", std::to_string(step_));
  writer_->post_meta("dropped_records", std::to_string(dropped));
  writer_->post_meta("dropped_steps", std::to_string(dropped_steps_));
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
  c.dropped_steps = dropped_steps_;
  return c;
}

}  // namespace ampdiag::agent
