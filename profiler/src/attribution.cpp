// RangeTable and Aggregator; see attribution.h.
#include "ampdiag/profiler/attribution.h"

#include <algorithm>

#include "ampdiag/profiler/precision.h"

namespace ampdiag::profiler {

namespace {

// Correlation ids of API calls that launched nothing (event records, queries) are never
// claimed; the oldest are forgotten once this many are held.
constexpr std::size_t kMaxExternals = std::size_t(1) << 18;
constexpr std::size_t kMaxStepMarks = 4096;
// A record waits this many batches for its external correlation before it counts as
// launched outside every range.
constexpr int kWaitRounds = 3;

bool is_ampdiag_kernel(const std::string& name) { return name.find("ampdiag") != std::string::npos; }

}  // namespace

void ActivityBatch::append(ActivityBatch&& other) {
  auto move_all = [](auto& to, auto& from) {
    if (to.empty()) {
      to.swap(from);
    } else {
      to.insert(to.end(), std::make_move_iterator(from.begin()), std::make_move_iterator(from.end()));
      from.clear();
    }
  };
  move_all(kernels, other.kernels);
  move_all(copies, other.copies);
  move_all(externals, other.externals);
}

std::uint64_t RangeTable::open(const Range& range) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (range.step > newest_step_) {
    newest_step_ = range.step;
    for (auto it = ranges_.begin(); it != ranges_.end();)
      it = it->second.step < newest_step_ - kKeepSteps ? ranges_.erase(it) : std::next(it);
  }
  const std::uint64_t id = next_id_++;
  ranges_.emplace(id, range);
  return id;
}

bool RangeTable::find(std::uint64_t external_id, Range& out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = ranges_.find(external_id);
  if (it == ranges_.end()) return false;
  out = it->second;
  return true;
}

std::size_t RangeTable::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ranges_.size();
}

void Aggregator::add(ActivityBatch&& batch) {
  std::uint32_t newest = 0;
  for (const ExternalCorrelation& e : batch.externals) {
    external_of_[e.correlation] = e.external_id;
    newest = std::max(newest, e.correlation);
  }
  for (KernelActivity& k : batch.kernels) waiting_.push_back({true, std::move(k), {}, 0});
  for (const CopyActivity& c : batch.copies) waiting_.push_back({false, {}, c, 0});
  std::vector<Waiting> still;
  for (Waiting& w : waiting_)
    if (!attribute(w, ++w.rounds > kWaitRounds)) still.push_back(std::move(w));
  waiting_.swap(still);
  if (external_of_.size() > kMaxExternals) {
    const std::uint32_t keep_from = newest > kMaxExternals / 2 ? newest - std::uint32_t(kMaxExternals / 2) : 0;
    for (auto it = external_of_.begin(); it != external_of_.end();)
      it = it->first < keep_from ? external_of_.erase(it) : std::next(it);
  }
}

void Aggregator::finish() {
  // The earliest launches first, so that each finds the step of the one before it.
  std::sort(waiting_.begin(), waiting_.end(), [](const Waiting& a, const Waiting& b) {
    return (a.kernel ? a.k.correlation : a.c.correlation) < (b.kernel ? b.k.correlation : b.c.correlation);
  });
  for (const Waiting& w : waiting_) attribute(w, true);
  waiting_.clear();
}

bool Aggregator::attribute(const Waiting& w, bool final) {
  const std::uint32_t correlation = w.kernel ? w.k.correlation : w.c.correlation;
  Range range;
  const auto ext = external_of_.find(correlation);
  bool found = ext != external_of_.end() && ranges_.find(ext->second, range);
  if (!found) {
    if (!final) return false;
    // Launched outside every range (or its range was forgotten): the step of the nearest
    // earlier launch, no module.
    auto before = step_at_.upper_bound(correlation);
    if (before == step_at_.begin()) {
      ++unattributed_;
      return true;
    }
    range = Range{std::prev(before)->second, -1, rundb::GpuPhase::kOther, rundb::GpuKind::kOtherKernel};
  }
  if (ext != external_of_.end()) external_of_.erase(ext);
  remember_step(correlation, range.step);
  if (!w.kernel) {
    sum(range, rundb::GpuKind::kMemcpy, w.c.start_ns, w.c.end_ns);
    return true;
  }
  // ampdiag's own kernels count as its own wherever they ran (the fused unscale runs in
  // the scaler's unscale).
  if (is_ampdiag_kernel(w.k.name)) range.phase = rundb::GpuPhase::kAmpdiag;
  sum(range, kernel_kind(w.k.name, range.hint), w.k.start_ns, w.k.end_ns);
  return true;
}

void Aggregator::sum(const Range& range, rundb::GpuKind kind, std::uint64_t start, std::uint64_t end) {
  auto& [count, ns] = sums_[{range.step, range.module_id, int(range.phase), int(kind)}];
  ++count;
  ns += end > start ? std::int64_t(end - start) : 0;
}

void Aggregator::remember_step(std::uint32_t correlation, std::int64_t step) {
  step_at_[correlation] = step;
  if (step_at_.size() > kMaxStepMarks) step_at_.erase(step_at_.begin());
}

std::vector<rundb::GpuTimeRow> Aggregator::take_rows() {
  std::vector<rundb::GpuTimeRow> rows;
  rows.reserve(sums_.size());
  for (const auto& [key, value] : sums_) {
    const auto& [step, module, phase, kind] = key;
    rows.push_back({step, module, rundb::GpuPhase(phase), rundb::GpuKind(kind), value.first, value.second});
  }
  sums_.clear();
  return rows;
}

}  // namespace ampdiag::profiler
