// RunDbWriter; see writer.h.
#include "ampdiag/rundb/writer.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <algorithm>

#include "schema.h"
#include "sqlite.h"

namespace ampdiag::rundb {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void bind_stats(Statement& s, int first, const StatValues& v) {
  for (int i = 0; i < kStatFieldCount; ++i) {
    const StatField& f = kStatFields[i];
    if (f.count)
      s.bind(first + i, v.*f.count);
    else
      s.bind(first + i, v.*f.real);
  }
}

// NULL for no histogram; anything but kHistBins counts would read back as a corrupt file.
void bind_histogram(Statement& s, int index, const std::vector<std::uint32_t>& histogram) {
  if (histogram.empty()) {
    s.bind_null(index);
    return;
  }
  if (histogram.size() != std::size_t(kHistBins))
    throw std::invalid_argument("a histogram has " + std::to_string(histogram.size()) + " bins; run.db's have " +
                                std::to_string(kHistBins));
  s.bind_blob(index, histogram.data(), int(histogram.size() * sizeof(std::uint32_t)));
}

// "?first, ?first+1, ..." for n parameters.
std::string placeholders(int first, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? ", ?" : "?") + std::to_string(first + i);
  return s;
}

std::string errno_hint(int error) {
  switch (error) {
    case ENOENT: return " (does its directory exist?)";
    case EACCES: case EPERM: return " (no permission to write there)";
    case EROFS: return " (read-only file system)";
    case ENOSPC: case EDQUOT: return " (the disk is full)";
    default: return "";
  }
}

// An exclusive flock() on the run.db for the writer's lifetime: a second writer, in this
// process or another, gets a clear error instead of replacing a run being written.
// (flock and SQLite's own POSIX locks do not interact on Linux.)
int take_writer_lock(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    throw RunDbError(path + ": cannot create: " + std::strerror(error) + errno_hint(error));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    if (error == EWOULDBLOCK)
      throw RunDbError(path + ": another ampdiag writer (in this process or another) is writing this run.db; "
                              "give each run its own path, or stop that run first");
    throw RunDbError(path + ": cannot lock: " + std::strerror(error));
  }
  return fd;
}

void clear_old_run(const std::string& path, int fd) {
  for (const char* suffix : {"-wal", "-shm", "-journal"}) {
    const std::string file = path + suffix;
    if (::unlink(file.c_str()) != 0 && errno != ENOENT)
      throw RunDbError(file + ": cannot remove the old run: " + std::strerror(errno));
  }
  if (::ftruncate(fd, 0) != 0) throw RunDbError(path + ": cannot clear the old run: " + std::strerror(errno));
}

}  // namespace

RunDbWriter::RunDbWriter(const std::string& path, bool overwrite) : path_(path) {
  if (path.empty()) throw RunDbError("run.db path is empty: give a file name such as run.db");
  if (path.find('\0') != std::string::npos)
    throw RunDbError(path.substr(0, path.find('\0')) + "...: the run.db path holds a NUL byte; give a plain file name");
  struct stat st {};
  const bool existed = ::stat(path.c_str(), &st) == 0;
  if (existed) {
    if (S_ISDIR(st.st_mode)) throw RunDbError(path + ": is a directory; give a file name such as " + path + "/run.db");
    if (!overwrite) throw RunDbError(path + ": already exists; choose another path or allow overwriting it");
  }
  lock_ = take_writer_lock(path);
  try {
    // Cleared in place, not unlinked: the lock stays on the file that is written.
    if (existed) clear_old_run(path, lock_);
    open_and_create();
  } catch (...) {
    // Never leave a half-created file that a reader would call "not a run.db".
    close_all();
    for (const char* suffix : {"", "-wal", "-shm", "-journal"}) ::unlink((path + suffix).c_str());
    throw;
  }
}

void RunDbWriter::open_and_create() {
  db_ = std::make_unique<Database>(path_, Database::Mode::kCreate);
  // WAL: readers see committed batches while training writes; NORMAL is durable against
  // a killed process (only a power cut can lose the last commits).
  // Set before the first table exists. 16 KiB pages: 1.11 M rows/s against 1.00 M at the
  // default 4 KiB (ampdiag_agent_bench), and fewer pages for a reader to walk.
  db_->exec("PRAGMA page_size = 16384;");
  db_->exec("PRAGMA journal_mode = WAL;");
  db_->exec("PRAGMA synchronous = NORMAL;");
  // Batches of ~100 k rows: a 64 MiB page cache keeps a batch's B-tree pages in memory.
  db_->exec("PRAGMA cache_size = -65536;");
  create_schema(*db_);
  meta_ = std::make_unique<Statement>(*db_, "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)");
  layer_ = std::make_unique<Statement>(
      *db_, "INSERT INTO layers VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)");
  module_ = std::make_unique<Statement>(*db_, "INSERT INTO modules (id, path, module_type, source, inputs) "
                                              "VALUES (?1, ?2, ?3, ?4, ?5)");
  step_ = std::make_unique<Statement>(
      *db_, "INSERT OR REPLACE INTO steps (step, loss, losses, scale_before, scale_after, found_inf, skipped, sampled, "
            "step_ns, agent_ns, wall_time) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)");
  const std::string stats = stat_column_list();
  grad_ = std::make_unique<Statement>(
      *db_, ("INSERT INTO grad_stats (step, layer_id, bwd_order, " + stats + ", histogram) VALUES (?1, ?2, ?3, " +
             placeholders(4, kStatFieldCount) + ", ?" + std::to_string(4 + kStatFieldCount) + ")")
                .c_str());
  act_ = std::make_unique<Statement>(
      *db_, ("INSERT INTO act_stats (step, fwd_order, module_id, micro_batch, " + stats + ", histogram) VALUES (?1, ?2, ?3, ?4, " +
             placeholders(5, kStatFieldCount) + ", ?" + std::to_string(5 + kStatFieldCount) + ")")
                .c_str());
  event_ = std::make_unique<Statement>(*db_, "INSERT INTO events (step, kind, detail, wall_time) VALUES (?1, ?2, ?3, ?4)");
  replay_ = std::make_unique<Statement>(
      *db_, "INSERT INTO replays (step, module, outcome, fp32_absmax, reason) VALUES (?1, ?2, ?3, ?4, ?5)");
  precision_ = std::make_unique<Statement>(
      *db_, "INSERT INTO precision_checks (step, module, dtype, numel, rel_error, zeroed, fp32_absmax) "
            "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)");
  weight_norms_ = std::make_unique<Statement>(
      *db_, "INSERT OR REPLACE INTO weight_norms (step, layer_id, l2, absmax) VALUES (?1, ?2, ?3, ?4)");
  gpu_ = std::make_unique<Statement>(
      *db_, "INSERT INTO gpu_time (step, module_id, phase, kind, count, ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6) "
            "ON CONFLICT (step, module_id, phase, kind) DO UPDATE SET count = count + excluded.count, ns = ns + excluded.ns");
  weights_ = std::make_unique<Statement>(
      *db_, "INSERT OR REPLACE INTO weight_updates (step, layer_id, nonzero, stalled) VALUES (?1, ?2, ?3, ?4)");
  samples_ = std::make_unique<Statement>(*db_, "INSERT INTO grad_samples (step, samples) VALUES (?1, ?2)");
  hist_sums_ = std::make_unique<Statement>(*db_, "INSERT INTO grad_hist_sums (last_step, layer_id, counts) VALUES (?1, ?2, ?3)");
  set_meta("started_at", std::to_string(now_seconds()));
  commit();
}

void RunDbWriter::close_all() noexcept {
  // Statements must go before the database they belong to, and the database before the
  // lock: closing any descriptor of the file drops the process's POSIX locks, SQLite's too.
  meta_.reset();
  layer_.reset();
  module_.reset();
  step_.reset();
  grad_.reset();
  act_.reset();
  event_.reset();
  replay_.reset();
  precision_.reset();
  weight_norms_.reset();
  samples_.reset();
  hist_sums_.reset();
  db_.reset();
  if (lock_ >= 0) ::close(lock_);
  lock_ = -1;
}

RunDbWriter::~RunDbWriter() {
  try {
    commit();
  } catch (...) {
    // Destructors must not throw; the caller learns of write errors from commit().
  }
  close_all();
}

void RunDbWriter::begin_if_needed() {
  if (!in_transaction_) {
    db_->exec("BEGIN;");
    in_transaction_ = true;
  }
}

void RunDbWriter::HistogramSums::add(const HistogramSums& other) {
  for (const auto& [layer, counts] : other.by_layer) {
    auto& sum = by_layer.try_emplace(layer, HistogramSum{}).first->second;
    for (int b = 0; b < kHistBins; ++b) sum[std::size_t(b)] += counts[std::size_t(b)];
  }
  last_step = std::max(last_step, other.last_step);
  rows += other.rows;
}

namespace {

// Enough histogram rows between two writes of their sums that grad_hist_sums stays a
// small fraction of grad_stats, few enough that a reader adds little after the last one.
constexpr std::int64_t kHistogramFlushRows = 1 << 16;
// A step's records go into rows of at most this many (3,000 bytes): SQLite keeps a row
// of up to ~16 KB whole in one 16 KiB page, so one 10 KB row per step would leave a third
// of every page empty; five 3,000-byte rows fill one.
constexpr std::size_t kRecordsPerSummary = 150;

}  // namespace

void RunDbWriter::add_histogram(const GradStatRow& r) {
  if (hist_broken_) return;
  // A new step closes the steps before it: their sums are complete and may be written.
  if (r.step > hist_open_.last_step && hist_open_.rows >= kHistogramFlushRows) {
    hist_ready_.add(hist_open_);
    hist_open_ = {};
  }
  auto& sum = hist_open_.by_layer.try_emplace(r.layer_id, HistogramSum{}).first->second;
  for (int b = 0; b < kHistBins; ++b) sum[std::size_t(b)] += r.histogram[std::size_t(b)];
  hist_open_.last_step = std::max(hist_open_.last_step, r.step);
  ++hist_open_.rows;
}

void RunDbWriter::write_summaries(bool finishing) {
  for (const auto& [step, records] : pending_samples_)
    for (std::size_t at = 0; at < records.size(); at += kRecordsPerSummary) {
      const std::size_t n = std::min(kRecordsPerSummary, records.size() - at);
      samples_->bind(1, step).bind_blob(2, records.data() + at, int(n * sizeof(SampleRecord))).run();
    }
  if (hist_broken_) return;
  if (finishing) {
    hist_ready_.add(hist_open_);
    hist_open_ = {};
  }
  // Cumulative since the last write: each write's rows replace nothing, they add up.
  for (const auto& [layer, counts] : hist_ready_.by_layer)
    hist_sums_->bind(1, hist_ready_.last_step).bind(2, layer).bind_blob(3, counts.data(), int(sizeof counts)).run();
}

void RunDbWriter::commit() { commit_transaction(false); }

void RunDbWriter::commit_transaction(bool finishing) {
  if (!in_transaction_) return;
  write_summaries(finishing);
  in_transaction_ = false;
  db_->exec("COMMIT;");
  pending_samples_.clear();
  pending_step_ = nullptr;
  hist_ready_ = {};
}

void RunDbWriter::rollback() noexcept {
  in_transaction_ = false;
  pending_samples_.clear();
  pending_step_ = nullptr;
  // Which histogram rows the lost transaction held is unknown: write no more sums, and
  // readers add up grad_stats' histograms after the last sums written (exact, slower).
  hist_broken_ = true;
  hist_open_ = {};
  hist_ready_ = {};
  // A failed COMMIT may or may not have ended the transaction: ask SQLite.
  if (db_ && sqlite3_get_autocommit(db_->handle()) == 0) sqlite3_exec(db_->handle(), "ROLLBACK;", nullptr, nullptr, nullptr);
}

void RunDbWriter::set_meta(const std::string& key, const std::string& value) {
  begin_if_needed();
  meta_->bind(1, key).bind(2, value).run();
}

void RunDbWriter::add_layer(const LayerRow& r) {
  begin_if_needed();
  layer_->bind(1, r.id).bind(2, r.name).bind(3, r.module_path).bind(4, r.module_type).bind(5, r.dtype);
  layer_->bind(6, r.shape).bind(7, r.numel).bind(8, std::int64_t(r.trainable)).bind(9, r.source).run();
}

void RunDbWriter::add_module(const ModuleRow& r) {
  begin_if_needed();
  module_->bind(1, r.id).bind(2, r.path).bind(3, r.module_type).bind(4, r.source).bind(5, r.inputs).run();
}

void RunDbWriter::add_step(const StepRow& r) {
  begin_if_needed();
  step_->bind(1, r.step).bind(2, r.loss).bind(3, std::max<std::int64_t>(0, r.losses)).bind(4, r.scale_before);
  step_->bind(5, r.scale_after).bind(6, std::int64_t(r.found_inf)).bind(7, std::int64_t(r.skipped));
  step_->bind(8, std::int64_t(r.sampled)).bind(9, r.step_ns).bind(10, r.agent_ns).bind(11, r.wall_time).run();
}

void RunDbWriter::add_grad_stat(const GradStatRow& r) {
  if (r.layer_id < 0 || r.layer_id > std::int64_t(UINT32_MAX))
    throw RunDbError(path_ + ": gradient row for layer id " + std::to_string(r.layer_id) +
                     ": layer ids run from 0 to 2^32-1 (add_layer numbers them)");
  begin_if_needed();
  grad_->bind(1, r.step).bind(2, r.layer_id).bind(3, r.bwd_order);
  bind_stats(*grad_, 4, r.stats);
  bind_histogram(*grad_, 4 + kStatFieldCount, r.histogram);
  grad_->run();
  const SampleRecord record = make_sample_record(r);
  // Rows come step by step: the step's vector is looked up once, not once per row.
  if (!pending_step_ || pending_step_->first != r.step) {
    const std::size_t expect = pending_step_ ? pending_step_->second.size() : 0;  // as many as the step before
    pending_step_ = &*pending_samples_.try_emplace(r.step).first;
    pending_step_->second.reserve(expect);
  }
  pending_step_->second.push_back(record);
  if (r.histogram.size() == std::size_t(kHistBins) && !record.nonfinite) add_histogram(r);
}

void RunDbWriter::add_act_stat(const ActStatRow& r) {
  begin_if_needed();
  act_->bind(1, r.step).bind(2, r.fwd_order).bind(3, r.module_id).bind(4, r.micro_batch);
  bind_stats(*act_, 5, r.stats);
  bind_histogram(*act_, 5 + kStatFieldCount, r.histogram);
  act_->run();
}

void RunDbWriter::add_event(const EventRow& r) {
  begin_if_needed();
  event_->bind(1, r.step).bind(2, r.kind).bind(3, r.detail).bind(4, r.wall_time == 0.0 ? now_seconds() : r.wall_time).run();
}

void RunDbWriter::add_gpu_time(const GpuTimeRow& r) {
  begin_if_needed();
  gpu_->bind(1, r.step).bind(2, r.module_id).bind(3, std::int64_t(r.phase)).bind(4, std::int64_t(r.kind)).bind(5, r.count)
      .bind(6, r.ns).run();
}

void RunDbWriter::add_weight_update(const WeightUpdateRow& r) {
  if (!r.counts_valid())
    throw std::invalid_argument("weight update of layer " + std::to_string(r.layer_id) + " at step " +
                                std::to_string(r.step) + ": " + std::to_string(r.stalled) + " stalled of " +
                                std::to_string(r.nonzero) + " is not a count of elements");
  begin_if_needed();
  weights_->bind(1, r.step).bind(2, r.layer_id).bind(3, r.nonzero).bind(4, r.stalled).run();
}

void RunDbWriter::add_replay(const ReplayRow& r) {
  begin_if_needed();
  replay_->bind(1, r.step).bind(2, r.module).bind(3, r.outcome).bind(4, r.fp32_absmax).bind(5, r.reason).run();
}

void RunDbWriter::add_precision_check(const PrecisionCheckRow& r) {
  if (r.numel <= 0 || r.zeroed < 0 || r.zeroed > r.numel || !std::isfinite(r.rel_error) || r.rel_error < 0 ||
      !std::isfinite(r.fp32_absmax) || r.fp32_absmax <= 0)
    throw std::invalid_argument("precision check of " + r.module + ": numel " + std::to_string(r.numel) + ", zeroed " +
                                std::to_string(r.zeroed) + ", rel_error " + std::to_string(r.rel_error) +
                                ", fp32_absmax " + std::to_string(r.fp32_absmax) + " is not a check the format holds");
  begin_if_needed();
  precision_->bind(1, r.step).bind(2, r.module).bind(3, r.dtype).bind(4, r.numel).bind(5, r.rel_error)
      .bind(6, r.zeroed).bind(7, r.fp32_absmax).run();
}

void RunDbWriter::add_weight_norm(const WeightNormRow& r) {
  if (!r.values_valid())
    throw std::invalid_argument("weight norm of layer " + std::to_string(r.layer_id) + " at step " + std::to_string(r.step) +
                                ": L2 " + std::to_string(r.l2) + ", abs-max " + std::to_string(r.absmax) +
                                " are not a parameter's norms");
  begin_if_needed();
  weight_norms_->bind(1, r.step).bind(2, r.layer_id).bind(3, r.l2).bind(4, r.absmax).run();
}

void RunDbWriter::finish() {
  set_meta("finished_at", std::to_string(now_seconds()));
  commit_transaction(true);
  db_->exec("PRAGMA wal_checkpoint(TRUNCATE);");
  // A finished run is one self-contained file (no -wal, no -shm beside it). A reader that
  // still has it open keeps it in WAL mode; that is harmless, so a refusal is ignored.
  sqlite3_exec(db_->handle(), "PRAGMA journal_mode = DELETE;", nullptr, nullptr, nullptr);
}

}  // namespace ampdiag::rundb
