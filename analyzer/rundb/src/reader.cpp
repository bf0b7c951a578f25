// RunDbReader; see reader.h.
#include "ampdiag/rundb/reader.h"

#include <sqlite3.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ampdiag/rundb/schema.h"
#include "schema.h"
#include "sqlite.h"

namespace ampdiag::rundb {

namespace {

StatValues read_stats(const Statement& s, int first) {
  StatValues v;
  for (int i = 0; i < kStatFieldCount; ++i) {
    const StatField& f = kStatFields[i];
    if (f.count)
      v.*f.count = s.int64(first + i);
    else
      v.*f.real = s.real(first + i);
  }
  return v;
}

constexpr int kHistogramBytes = kHistBins * int(sizeof(std::uint32_t));

// A histogram column: NULL (no histogram) or exactly kHistBins counts. `row` names the row
// in the error, and is only asked for then.
template <typename NameRow>
void read_histogram(const std::string& path, const Statement& q, int column, std::vector<std::uint32_t>& out,
                    NameRow row) {
  int bytes = 0;
  const void* blob = q.blob(column, &bytes);
  out.clear();
  if (bytes == 0) return;
  if (bytes != kHistogramBytes)
    throw_corrupt(path, row() + " has a histogram of " + std::to_string(bytes) + " bytes, not " +
                            std::to_string(kHistogramBytes));
  out.resize(kHistBins);
  std::memcpy(out.data(), blob, std::size_t(kHistogramBytes));
}

// Format 1 kept replays as events: "module=PATH fp32_finite=0|1 fp32_absmax=X" or
// "module=PATH error=TYPE: MESSAGE". Read here so that nothing above parses free text.
bool parse_v1_replay(const EventRow& e, ReplayRow& out) {
  if (e.kind != "replay" || e.detail.rfind("module=", 0) != 0) return false;
  const auto error = e.detail.find(" error=");
  const auto finite = e.detail.find(" fp32_finite=");
  const auto end = std::min(error, finite);
  if (end == std::string::npos) return false;
  out.step = e.step;
  out.module = e.detail.substr(7, end - 7);
  if (error != std::string::npos && error < finite) {
    out.outcome = "unconfirmed";
    out.reason = "the replay raised " + e.detail.substr(error + 7);
    out.fp32_absmax = std::nan("");
    return true;
  }
  out.outcome = e.detail.compare(finite + 13, 1, "1") == 0 ? "finite" : "nonfinite";
  const auto absmax = e.detail.find(" fp32_absmax=");
  out.fp32_absmax = absmax == std::string::npos ? std::nan("") : std::strtod(e.detail.c_str() + absmax + 13, nullptr);
  return true;
}

bool has_sqlite_header(const std::string& path) {
  static constexpr char kMagic[16] = "SQLite format 3";  // and its NUL: 16 bytes
  char head[16] = {};
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  const std::size_t got = std::fread(head, 1, sizeof head, f);
  std::fclose(f);
  return got == sizeof head && std::memcmp(head, kMagic, sizeof head) == 0;
}

}  // namespace

RunDbReader::RunDbReader(const std::string& path) : path_(path) {
  if (path.find('\0') != std::string::npos)
    throw RunDbError(path.substr(0, path.find('\0')) + "...: the path holds a NUL byte; give a plain file name");
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw RunDbError(path + ": no such file");
  if (S_ISDIR(st.st_mode)) throw RunDbError(path + ": is a directory, not a run.db");
  if (st.st_size == 0) throw RunDbError(path + ": is empty, not a run.db (was the training process started?)");
  db_ = std::make_unique<Database>(path, Database::Mode::kReadOnly);
  std::int64_t app_id = 0;
  try {
    Statement q(*db_, "PRAGMA application_id");
    if (q.next()) app_id = q.int64(0);
  } catch (const RunDbError&) {
    // SQLite says "malformed" for a damaged file and "not a database" for any other: only
    // the header tells them apart for the user.
    if (!has_sqlite_header(path))
      throw RunDbError(path + ": not a SQLite database (is it a run.db? it may be truncated or corrupted)");
    throw RunDbError(path + ": a damaged SQLite database (" + sqlite3_errmsg(db_->handle()) +
                     "): truncated or corrupted, SQLite cannot read even its schema");
  }
  if (app_id != kApplicationId) throw RunDbError(path + ": a SQLite database, but not an ampdiag run.db");
  // A legitimate read needs a few hundred SQLite instructions per byte of the file at
  // most (a full scan of every table and SQLite's quick_check); a hostile file gets a bound.
  db_->bound_work(std::uint64_t(1) << 27 | std::uint64_t(st.st_size) * 1000);
  // Large runs are read by scanning: map the file instead of copying pages through the cache.
  db_->exec("PRAGMA mmap_size = 1073741824; PRAGMA cache_size = -65536;");
  check_tables({"meta", "layers", "modules", "steps", "grad_stats", "act_stats", "events"});
  std::string version;
  try {
    Statement q(*db_, "SELECT value FROM meta WHERE key = 'schema_version'");
    if (q.next()) version = q.text(0);
  } catch (const RunDbError& e) {
    throw RunDbError(path + ": run.db is incomplete or corrupted (" + e.what() + ")");
  }
  if (version.empty()) throw RunDbError(path + ": run.db has no schema_version: incomplete or corrupted");
  version_ = std::atoi(version.c_str());
  if (version_ > kSchemaVersion)
    throw RunDbError(path + ": written in run.db format " + version + ", newer than this ampdiag reads (" +
                     std::to_string(kSchemaVersion) + "): upgrade ampdiag");
  if (version_ < 1) throw RunDbError(path + ": run.db has an invalid schema_version '" + version + "'");
  if (version_ >= 2) check_tables({"replays"});
  if (version_ >= 3) check_tables({"gpu_time"});
  if (version_ >= 4) check_tables({"weight_updates"});
  {
    Statement q(*db_, "SELECT 1 FROM sqlite_master WHERE name = 'grad_samples'", "the schema (sqlite_master)");
    summaries_ = q.next();
  }
  if (summaries_) check_tables({"grad_samples", "grad_hist_sums"});
  {
    // Added to format 4 as an optional table: files written before it lack it.
    Statement q(*db_, "SELECT 1 FROM sqlite_master WHERE name = 'precision_checks'", "the schema (sqlite_master)");
    precision_checks_ = q.next();
  }
  if (precision_checks_) check_tables({"precision_checks"});
  {
    Statement q(*db_, "SELECT 1 FROM sqlite_master WHERE name = 'weight_norms'", "the schema (sqlite_master)");
    weight_norms_ = q.next();
  }
  if (weight_norms_) check_tables({"weight_norms"});
  {
    // Added to format 4 as an optional column: files written before it lack it.
    Statement q(*db_, "SELECT 1 FROM pragma_table_info('act_stats') WHERE name = 'histogram'", "the schema of act_stats");
    act_histograms_ = q.next();
  }
}

void RunDbReader::check_tables(const std::vector<const char*>& names) {
  for (const char* name : names) {
    Statement q(*db_, "SELECT type, sql FROM sqlite_master WHERE name = ?1", "the schema (sqlite_master)");
    q.bind(1, std::string(name));
    if (!q.next()) throw RunDbError(path_ + ": run.db has no table " + name + ": incomplete or corrupted");
    // Only the writer's own tables are read: a view or a virtual table could compute anything.
    if (q.text(0) != "table" || q.text(1).rfind("CREATE TABLE", 0) != 0)
      throw_corrupt(path_, std::string(name) + " is a " + q.text(0) + ", not the table the writer creates");
  }
}

RunDbReader::~RunDbReader() = default;

bool RunDbReader::finished() {
  Statement q(*db_, "SELECT 1 FROM meta WHERE key = 'finished_at'", "table meta");
  return q.next();
}

std::vector<std::string> RunDbReader::integrity_problems(bool full) {
  Statement q(*db_, full ? "PRAGMA integrity_check" : "PRAGMA quick_check",
              full ? "the file with SQLite's integrity_check" : "the file with SQLite's quick_check");
  std::vector<std::string> out;
  while (q.next()) {
    // One row can hold many problems, a line each, after a "*** in database main ***" line.
    const std::string text = q.text(0);
    std::size_t begin = 0;
    while (begin <= text.size()) {
      std::size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      std::string line = text.substr(begin, end - begin);
      if (!line.empty() && line != "ok" && line.rfind("*** in database", 0) != 0) out.push_back(std::move(line));
      begin = end + 1;
    }
  }
  return out;
}

std::map<std::string, std::string> RunDbReader::meta() {
  std::map<std::string, std::string> out;
  Statement q(*db_, "SELECT key, value FROM meta", "table meta");
  while (q.next()) out[q.text(0)] = q.text(1);
  return out;
}

namespace {

// The C++ agent wrote c10's names ("Half") before it wrote Python's, as the Python agent
// does ("float16"): read as the latter, so that every reader compares one spelling.
std::string python_dtype(std::string dtype) {
  if (dtype == "Half") return "float16";
  if (dtype == "BFloat16") return "bfloat16";
  if (dtype == "Float") return "float32";
  if (dtype == "Double") return "float64";
  return dtype;
}

}  // namespace

std::vector<LayerRow> RunDbReader::layers() {
  std::vector<LayerRow> out;
  Statement q(*db_, "SELECT id, name, module_path, module_type, dtype, shape, numel, trainable, source FROM layers ORDER BY id", "table layers");
  while (q.next())
    out.push_back({q.int64(0), q.text(1), q.text(2), q.text(3), python_dtype(q.text(4)), q.text(5), q.int64(6),
                   q.int64(7) != 0, q.text(8)});
  return out;
}

std::vector<ModuleRow> RunDbReader::modules() {
  std::vector<ModuleRow> out;
  Statement q(*db_, version_ >= 2 ? "SELECT id, path, module_type, source, inputs FROM modules ORDER BY id"
                                   : "SELECT id, path, module_type, source, '' FROM modules ORDER BY id",
                "table modules");
  while (q.next()) out.push_back({q.int64(0), q.text(1), q.text(2), q.text(3), q.text(4)});
  return out;
}

std::vector<StepRow> RunDbReader::steps(std::int64_t first_step) {
  std::vector<StepRow> out;
  Statement q(*db_, version_ >= 2 ? "SELECT step, loss, losses, scale_before, scale_after, found_inf, skipped, sampled, "
                                     "step_ns, agent_ns, wall_time FROM steps WHERE step >= ?1 ORDER BY step"
                                   : "SELECT step, loss, -1, scale_before, scale_after, found_inf, skipped, sampled, "
                                     "step_ns, agent_ns, wall_time FROM steps WHERE step >= ?1 ORDER BY step",
                "table steps");
  q.bind(1, first_step);
  while (q.next()) {
    StepRow r;
    r.step = q.int64(0);
    r.loss = q.real(1);
    r.losses = q.int64(2);
    r.scale_before = q.real(3);
    r.scale_after = q.real(4);
    r.found_inf = q.int64(5) != 0;
    r.skipped = q.int64(6) != 0;
    r.sampled = q.int64(7) != 0;
    r.step_ns = q.int64(8);
    r.agent_ns = q.int64(9);
    r.wall_time = q.real(10);
    out.push_back(r);
  }
  return out;
}

std::vector<EventRow> RunDbReader::events() {
  std::vector<EventRow> out;
  Statement q(*db_, "SELECT step, kind, detail, wall_time FROM events ORDER BY id", "table events");
  while (q.next()) {
    EventRow e{q.int64(0), q.text(1), q.text(2), q.real(3)};
    ReplayRow unused;
    if (version_ == 1 && parse_v1_replay(e, unused)) continue;  // read by replays()
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<GpuTimeRow> RunDbReader::gpu_time() {
  std::vector<GpuTimeRow> out;
  if (version_ < 3) return out;
  Statement q(*db_, "SELECT step, module_id, phase, kind, count, ns FROM gpu_time ORDER BY step, module_id, phase, kind",
              "table gpu_time");
  while (q.next()) {
    const std::int64_t phase = q.int64(2), kind = q.int64(3);
    if (phase < 0 || phase >= kGpuPhaseCount || kind < 0 || kind >= kGpuKindCount)
      throw_corrupt(path_, "gpu_time holds phase " + std::to_string(phase) + ", kind " + std::to_string(kind) +
                               ", which no writer writes");
    out.push_back({q.int64(0), q.int64(1), GpuPhase(phase), GpuKind(kind), q.int64(4), q.int64(5)});
  }
  return out;
}

std::vector<WeightUpdateRow> RunDbReader::weight_updates() {
  std::vector<WeightUpdateRow> out;
  if (version_ < 4) return out;
  Statement q(*db_, "SELECT step, layer_id, nonzero, stalled FROM weight_updates ORDER BY step, layer_id",
              "table weight_updates");
  while (q.next()) {
    WeightUpdateRow row{q.int64(0), q.int64(1), q.int64(2), q.int64(3)};
    if (!row.counts_valid())
      throw_corrupt(path_, "weight_updates says " + std::to_string(row.stalled) + " of " + std::to_string(row.nonzero) +
                               " elements of layer " + std::to_string(row.layer_id) + " stalled at step " +
                               std::to_string(row.step) + ", which no writer writes");
    out.push_back(row);
  }
  return out;
}

std::vector<ReplayRow> RunDbReader::replays() {
  std::vector<ReplayRow> out;
  if (version_ == 1) {
    Statement q(*db_, "SELECT step, kind, detail, wall_time FROM events WHERE kind = 'replay' ORDER BY id", "table events");
    while (q.next()) {
      ReplayRow r;
      if (parse_v1_replay({q.int64(0), q.text(1), q.text(2), q.real(3)}, r)) out.push_back(std::move(r));
    }
    return out;
  }
  Statement q(*db_, "SELECT step, module, outcome, fp32_absmax, reason FROM replays ORDER BY id", "table replays");
  while (q.next()) out.push_back({q.int64(0), q.text(1), q.text(2), q.real(3), q.text(4)});
  return out;
}

std::vector<PrecisionCheckRow> RunDbReader::precision_checks() {
  std::vector<PrecisionCheckRow> out;
  if (!precision_checks_) return out;
  Statement q(*db_, "SELECT step, module, dtype, numel, rel_error, zeroed, fp32_absmax FROM precision_checks ORDER BY id",
              "table precision_checks");
  while (q.next()) {
    for (int column : {0, 3, 5})
      if (sqlite3_column_type(q.handle(), column) != SQLITE_INTEGER)
        throw_corrupt(path_, "precision_checks has a step or count that is not an integer");
    PrecisionCheckRow r{q.int64(0), q.text(1), q.text(2), q.int64(3), q.real(4), q.int64(5), q.real(6)};
    if (r.numel <= 0 || r.zeroed < 0 || r.zeroed > r.numel || !(r.rel_error >= 0) || !std::isfinite(r.rel_error) ||
        !(r.fp32_absmax > 0) || !std::isfinite(r.fp32_absmax))
      throw_corrupt(path_, "precision_checks has a check of " + r.module + " at step " + std::to_string(r.step) +
                               " with values no check has (" + std::to_string(r.numel) + " values, " +
                               std::to_string(r.zeroed) + " zeroed, relative error " + std::to_string(r.rel_error) + ")");
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<WeightNormRow> RunDbReader::weight_norms() {
  std::vector<WeightNormRow> out;
  if (!weight_norms_) return out;
  Statement q(*db_, "SELECT step, layer_id, l2, absmax FROM weight_norms ORDER BY step, layer_id", "table weight_norms");
  while (q.next()) {
    if (sqlite3_column_type(q.handle(), 0) != SQLITE_INTEGER || sqlite3_column_type(q.handle(), 1) != SQLITE_INTEGER)
      throw_corrupt(path_, "weight_norms has a step or layer that is not an integer");
    WeightNormRow r{q.int64(0), q.int64(1), q.real(2), q.real(3)};
    if (!r.values_valid())
      throw_corrupt(path_, "weight_norms says layer " + std::to_string(r.layer_id) + " had L2 " + std::to_string(r.l2) +
                               " and abs-max " + std::to_string(r.absmax) + " at step " + std::to_string(r.step) +
                               ", which no parameter has");
    out.push_back(r);
  }
  return out;
}

bool RunDbReader::grad_step_range(std::int64_t& first, std::int64_t& last) {
  // Two subqueries: SQLite answers a lone MIN or MAX from the primary key, but scans the
  // whole table for both in one SELECT.
  Statement q(*db_, "SELECT (SELECT MIN(step) FROM grad_stats), (SELECT MAX(step) FROM grad_stats)", "table grad_stats");
  if (!q.next() || sqlite3_column_type(q.handle(), 0) == SQLITE_NULL) return false;  // no rows
  // SQLite orders numbers before text and blobs: a damaged value can be either end.
  if (sqlite3_column_type(q.handle(), 0) != SQLITE_INTEGER || sqlite3_column_type(q.handle(), 1) != SQLITE_INTEGER)
    throw_corrupt(path_, "grad_stats has a step that is not an integer");
  first = q.int64(0);
  last = q.int64(1);
  // A damaged b-tree can hand out its first and last entries out of order.
  if (last < first)
    throw_corrupt(path_, "grad_stats' first step (" + std::to_string(first) + ") is after its last (" + std::to_string(last) + ")");
  return true;
}

void RunDbReader::for_each_grad_stat(const std::function<void(const GradStatRow&)>& visit, const GradScan& scan) {
  Statement q(*db_, ("SELECT step, layer_id, bwd_order, " + stat_column_list() + (scan.histograms ? ", histogram" : "") +
                     " FROM grad_stats WHERE step >= ?1 AND step <= ?2 ORDER BY step, layer_id")
                        .c_str(),
              "table grad_stats");
  q.bind(1, scan.first).bind(2, scan.last);
  GradStatRow r;
  sqlite3_stmt* st = q.handle();
  while (q.next()) {
    // Straight from SQLite, not through Statement: this loop reads every gradient row.
    r.step = sqlite3_column_int64(st, 0);
    r.layer_id = sqlite3_column_int64(st, 1);
    r.bwd_order = sqlite3_column_int64(st, 2);
    for (int i = 0; i < kStatFieldCount; ++i) {
      const StatField& f = kStatFields[i];
      if (f.count)
        r.stats.*f.count = sqlite3_column_int64(st, 3 + i);
      else {
        // NULL (a NaN the writer stored) reads as 0.0: only then is the type worth asking.
        const double v = sqlite3_column_double(st, 3 + i);
        r.stats.*f.real = v == 0.0 && sqlite3_column_type(st, 3 + i) == SQLITE_NULL ? NAN : v;
      }
    }
    if (scan.histograms) {
      read_histogram(path_, q, 3 + kStatFieldCount, r.histogram, [&] {
        return "grad_stats row (step " + std::to_string(r.step) + ", layer " + std::to_string(r.layer_id) + ")";
      });
    }
    visit(r);
  }
}

std::int64_t RunDbReader::step_count() {
  Statement q(*db_, "SELECT COUNT(*) FROM steps", "table steps");
  return q.next() ? q.int64(0) : 0;
}

std::vector<GradStatRow> RunDbReader::grad_stats() {
  std::vector<GradStatRow> out;
  for_each_grad_stat([&](const GradStatRow& r) { out.push_back(r); });
  return out;
}

bool RunDbReader::sample_id_range(std::int64_t& first, std::int64_t& last) {
  if (!summaries_) return false;
  Statement q(*db_, "SELECT (SELECT MIN(id) FROM grad_samples), (SELECT MAX(id) FROM grad_samples)", "table grad_samples");
  if (!q.next() || sqlite3_column_type(q.handle(), 0) == SQLITE_NULL) return false;
  first = q.int64(0);
  last = q.int64(1);
  if (last < first)
    throw_corrupt(path_, "grad_samples' first id (" + std::to_string(first) + ") is after its last (" + std::to_string(last) + ")");
  return true;
}

void RunDbReader::for_each_sample_blob(
    std::int64_t first, std::int64_t last,
    const std::function<void(std::int64_t step, const std::vector<SampleRecord>& records)>& visit) {
  Statement q(*db_, "SELECT step, samples FROM grad_samples WHERE id >= ?1 AND id <= ?2 ORDER BY id", "table grad_samples");
  q.bind(1, first).bind(2, last);
  std::vector<SampleRecord> records;
  while (q.next()) {
    if (sqlite3_column_type(q.handle(), 0) != SQLITE_INTEGER) throw_corrupt(path_, "grad_samples has a step that is not an integer");
    const std::int64_t step = q.int64(0);
    int bytes = 0;
    const void* blob = q.blob(1, &bytes);
    if (bytes <= 0 || bytes % int(sizeof(SampleRecord)) != 0)
      throw_corrupt(path_, "grad_samples' summary of step " + std::to_string(step) + " has " + std::to_string(bytes) +
                               " bytes, not a whole number of " + std::to_string(sizeof(SampleRecord)) + "-byte records");
    records.resize(std::size_t(bytes) / sizeof(SampleRecord));
    std::memcpy(records.data(), blob, std::size_t(bytes));  // SQLite's buffer need not be aligned
    visit(step, records);
  }
}

std::int64_t RunDbReader::histogram_sums(std::map<std::int64_t, std::vector<std::uint64_t>>& sums, std::int64_t* rows) {
  if (!summaries_) return -1;
  Statement q(*db_, "SELECT last_step, layer_id, counts FROM grad_hist_sums ORDER BY id", "table grad_hist_sums");
  constexpr int kBytes = kHistBins * int(sizeof(std::uint64_t));
  std::int64_t last = -1;
  while (q.next()) {
    int bytes = 0;
    const void* blob = q.blob(2, &bytes);
    if (bytes != kBytes)
      throw_corrupt(path_, "grad_hist_sums has a sum of " + std::to_string(bytes) + " bytes, not " + std::to_string(kBytes));
    last = std::max(last, q.int64(0));
    if (rows) ++*rows;
    auto& sum = sums[q.int64(1)];
    sum.resize(kHistBins, 0);
    std::uint64_t counts[kHistBins];
    std::memcpy(counts, blob, sizeof counts);
    for (int b = 0; b < kHistBins; ++b) sum[std::size_t(b)] += counts[b];
  }
  return last;
}

std::vector<ActStatRow> RunDbReader::act_stats() {
  std::vector<ActStatRow> out;
  for_each_act_stat([&](const ActStatRow& r) { out.push_back(r); });
  return out;
}

void RunDbReader::for_each_act_stat(const std::function<void(const ActStatRow&)>& visit,
                                    std::pair<std::int64_t, std::int64_t> after, bool histograms) {
  histograms = histograms && act_histograms_;
  Statement q(*db_, ("SELECT step, fwd_order, module_id, " + std::string(version_ >= 2 ? "micro_batch" : "0") + ", " +
                     stat_column_list() + (histograms ? ", histogram" : "") +
                     " FROM act_stats WHERE (step, fwd_order) > (?1, ?2) ORDER BY step, fwd_order")
                        .c_str(),
                "table act_stats");
  q.bind(1, after.first).bind(2, after.second);
  ActStatRow r;
  while (q.next()) {
    r.step = q.int64(0);
    r.fwd_order = q.int64(1);
    r.module_id = q.int64(2);
    r.micro_batch = q.int64(3);
    r.stats = read_stats(q, 4);
    if (histograms) {
      read_histogram(path_, q, 4 + kStatFieldCount, r.histogram, [&] {
        return "act_stats row (step " + std::to_string(r.step) + ", fwd_order " + std::to_string(r.fwd_order) + ")";
      });
    }
    visit(r);
  }
}

RunDbReader::Snapshot::Snapshot(RunDbReader& reader) : reader_(reader) { reader_.db_->exec("BEGIN;"); }

RunDbReader::Snapshot::~Snapshot() {
  try {
    reader_.db_->exec("COMMIT;");
  } catch (const std::exception&) {
    // A read transaction has nothing to lose: the connection closes with the reader.
  }
}

}  // namespace ampdiag::rundb
