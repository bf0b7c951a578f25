// Reads a run.db, also while it is being written. Refuses, with a one-line RunDbError,
// anything that is not a run.db of a format this build understands, and reports damage
// instead of reading around it: every SQLite error on a read, a table that is not a plain
// table, and a query that needs far more work than a file of its size can hold throw.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ampdiag/rundb/rows.h"
#include "ampdiag/rundb/samples.h"

namespace ampdiag::rundb {

class Database;

class RunDbReader {
 public:
  explicit RunDbReader(const std::string& path);
  ~RunDbReader();
  RunDbReader(const RunDbReader&) = delete;
  RunDbReader& operator=(const RunDbReader&) = delete;

  int schema_version() const { return version_; }
  const std::string& path() const { return path_; }
  // True once the writer called finish(): the file is complete.
  bool finished();

  std::map<std::string, std::string> meta();
  // SQLite's quick_check (or, with `full`, its slower integrity_check, which also compares
  // every index with its table): nothing when the file is intact, else one entry per problem
  // found (SQLite stops at 100).
  std::vector<std::string> integrity_problems(bool full);
  std::vector<LayerRow> layers();
  std::vector<ModuleRow> modules();
  // Steps in step order; from `first_step` on, if given.
  std::vector<StepRow> steps(std::int64_t first_step = INT64_MIN);
  std::int64_t step_count();
  // Agent events other than replays.
  std::vector<EventRow> events();
  // FP32 replays (format 1 files: read from their events).
  std::vector<ReplayRow> replays();
  // The precision checks in the order they were made; none in files written before the
  // table existed. A row outside what the writer writes throws (corrupt).
  std::vector<PrecisionCheckRow> precision_checks();
  // The weight sampler's rows in step, then layer order; none in files written before the
  // table existed. Values no norm has throw (corrupt).
  std::vector<WeightNormRow> weight_norms();
  // The first and last step of grad_stats; false when it has no rows.
  bool grad_step_range(std::int64_t& first, std::int64_t& last);
  // Which grad_stats rows to visit: steps first..last; without `histograms` the rows'
  // histograms stay empty (reading them costs).
  struct GradScan {
    std::int64_t first = INT64_MIN, last = INT64_MAX;
    bool histograms = true;
  };
  // Row by row, in (step, layer) order: a long run does not need to fit in memory. A
  // histogram is NULL or exactly kHistBins counts; any other size throws (corrupt).
  void for_each_grad_stat(const std::function<void(const GradStatRow&)>& visit, const GradScan& scan);
  void for_each_grad_stat(const std::function<void(const GradStatRow&)>& visit) { for_each_grad_stat(visit, GradScan{}); }
  std::vector<GradStatRow> grad_stats();
  std::vector<ActStatRow> act_stats();
  // The profiler's rows in (step, module, phase, kind) order; none in files before format 3.
  // A phase or kind outside the format's throws (corrupt).
  std::vector<GpuTimeRow> gpu_time();
  // In step, then layer order; none in files before format 4.
  std::vector<WeightUpdateRow> weight_updates();
  // Row by row in (step, fwd_order) order, the rows after (step, fwd_order) = `after`.
  // Histograms as for_each_grad_stat's (left empty without `histograms`); empty in files
  // written before act_stats had them.
  void for_each_act_stat(const std::function<void(const ActStatRow&)>& visit,
                         std::pair<std::int64_t, std::int64_t> after = {INT64_MIN, INT64_MIN}, bool histograms = true);

  // One read transaction for as long as it lives: every read through the reader sees the
  // file as it was when the first of them ran, however much the writer commits meanwhile.
  class Snapshot {
   public:
    explicit Snapshot(RunDbReader& reader);
    ~Snapshot();
    Snapshot(const Snapshot&) = delete;
    Snapshot& operator=(const Snapshot&) = delete;

   private:
    RunDbReader& reader_;
  };

  // The writer's summaries of grad_stats (samples.h): whether the file has them (files
  // written before them do not), the first and last row id of grad_samples (false: none),
  // and its rows first..last in id order as (step, records). A summary whose size is not
  // a whole number of records throws (corrupt).
  bool has_summaries() const { return summaries_; }
  bool sample_id_range(std::int64_t& first, std::int64_t& last);
  void for_each_sample_blob(std::int64_t first, std::int64_t last,
                            const std::function<void(std::int64_t step, const std::vector<SampleRecord>& records)>& visit);
  // Adds grad_hist_sums' per-layer sums into `sums` (by layer id, kHistBins counts each);
  // returns the last step they cover, -1 when there are none. grad_stats' histograms of
  // later steps are not in them. `rows`, if given, counts the table's rows.
  std::int64_t histogram_sums(std::map<std::int64_t, std::vector<std::uint64_t>>& sums, std::int64_t* rows = nullptr);

 private:
  void check_tables(const std::vector<const char*>& names);

  std::string path_;
  std::unique_ptr<Database> db_;
  int version_ = 0;
  bool summaries_ = false;
  bool act_histograms_ = false;
  bool precision_checks_ = false;  // the file has the precision_checks table
  bool weight_norms_ = false;      // the file has the weight_norms table  // act_stats has its histogram column
};

}  // namespace ampdiag::rundb
