// load_run: scans grad_stats in parallel over disjoint step ranges (one RunDbReader
// per thread; a 10 M-row run needs ~2.3 s on one thread), then merges in step order.
#include <signal.h>

#include <algorithm>
#include <map>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/samples.h"

namespace ampdiag::analyzer {

namespace {

// Steps are stored as int32 in memory (GradSample); the agent numbers them from 0.
constexpr std::int64_t kMaxStep = INT32_MAX;

// What one thread gathers from its step range.
struct Partial {
  std::vector<std::vector<GradSample>> samples;                     // by layer
  std::vector<std::pair<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>>> nonfinite;  // step -> (bwd_order, layer)
  std::map<std::int64_t, std::int64_t> last_finite_before;          // step -> layer
  std::vector<std::pair<double, std::int64_t>> least_nonzero;       // by layer: (|g|, step)
  std::vector<std::vector<std::uint64_t>> histogram;                // by layer, summed
  std::int64_t rows = 0;
  std::string error;
};

// What a scan of grad_stats gathers: a full scan everything; with the writer's summaries
// only the backward order of the steps that went non-finite, and the histograms of the
// steps after the last written sums.
struct ScanWhat {
  bool samples = true;     // GradSamples and the least non-zero |g|
  bool histograms = true;  // per-layer sums of finite rows' histograms
  bool order = true;       // non-finite layers in backward order, and the finite one before
};

void add_sample(Partial& out, std::int64_t step, const rundb::SampleRecord& r) {
  const std::size_t layer = r.layer_id;
  if (!r.nonfinite) {
    auto& least = out.least_nonzero[layer];
    if (r.amin_nz > 0 && (least.second < 0 || r.amin_nz < least.first)) least = {r.amin_nz, step};
  }
  out.samples[layer].push_back({std::int32_t(step), r.absmax, r.l2, r.zero_q, r.nonfinite, r.sub_q});
}

void start_partial(Partial& out, std::size_t layer_count) {
  out.samples.assign(layer_count, {});
  out.least_nonzero.assign(layer_count, {0.0, -1});
  out.histogram.assign(layer_count, {});
}

[[noreturn]] void unknown_layer(const std::string& path, const char* table, std::int64_t layer, std::size_t layer_count) {
  rundb::throw_corrupt(path, std::string(table) + " has a row for layer " + std::to_string(layer) +
                                 ", but the layers table has ids 0 to " + std::to_string(std::int64_t(layer_count) - 1));
}

void scan_ranges(const std::string& path, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, std::size_t layer_count,
                 ScanWhat what, Partial& out, std::atomic<std::int64_t>& progress) {
  try {
    rundb::RunDbReader reader(path);  // one connection per thread, never shared
    start_partial(out, layer_count);
    std::int64_t current_step = -1;
    // This step's finite rows as (bwd_order, layer): once the step ends, the one just
    // before its first non-finite gradient is kept.
    std::int64_t row_step = -1;
    std::vector<std::pair<std::int64_t, std::int64_t>> finite_rows;
    auto close_step = [&] {
      if (!out.nonfinite.empty() && out.nonfinite.back().first == row_step) {
        const std::int64_t first = std::min_element(out.nonfinite.back().second.begin(), out.nonfinite.back().second.end())->first;
        std::pair<std::int64_t, std::int64_t> best{-1, -1};
        for (const auto& r : finite_rows)
          if (r.first < first && r.first > best.first) best = r;
        if (best.second >= 0) out.last_finite_before[row_step] = best.second;
      }
      finite_rows.clear();
    };
    auto visit = [&](const rundb::GradStatRow& g) {
      const std::int64_t step = g.step, layer = g.layer_id;
      if (layer < 0 || std::size_t(layer) >= layer_count) unknown_layer(path, "grad_stats", layer, layer_count);
      if (step != row_step) {
        close_step();
        row_step = step;
      }
      const bool nonfinite = (g.stats.nan | g.stats.inf) != 0;
      if (what.samples) add_sample(out, step, rundb::make_sample_record(g));
      if (what.histograms && !nonfinite && !g.histogram.empty()) {
        auto& sum = out.histogram[std::size_t(layer)];
        sum.resize(g.histogram.size(), 0);
        for (std::size_t b = 0; b < g.histogram.size(); ++b) sum[b] += g.histogram[b];
      }
      if (what.order) {
        if (nonfinite) {
          if (out.nonfinite.empty() || current_step != step) {
            out.nonfinite.push_back({step, {}});
            current_step = step;
          }
          const std::int64_t order = g.bwd_order < 0 ? INT64_MAX : g.bwd_order;  // no hook saw it: after all that did
          out.nonfinite.back().second.push_back({order, layer});
        } else if (g.bwd_order >= 0) {
          finite_rows.push_back({g.bwd_order, layer});
        }
      }
      if (what.samples && (++out.rows & 0xffff) == 0) progress.fetch_add(0x10000, std::memory_order_relaxed);
    };
    for (const auto& [first, last] : ranges) {
      rundb::RunDbReader::GradScan scan;
      scan.first = first, scan.last = last, scan.histograms = what.histograms;
      reader.for_each_grad_stat(visit, scan);
      close_step();
    }
  } catch (const std::exception& e) {
    out.error = e.what();
  }
}

// The writer's summaries, rows first..last of grad_samples: the samples, the least
// non-zero |g|, and which steps went non-finite (their order is read from grad_stats).
// `reserve`: samples to expect per layer (reserved, not touched: growing vectors of a
// 50 M-row run by doubling would copy and fault in twice the memory).
void read_summaries(const std::string& path, std::int64_t first, std::int64_t last, std::size_t layer_count, std::size_t reserve,
                    Partial& out, std::vector<std::int64_t>& nonfinite_steps, std::atomic<std::int64_t>& progress) {
  try {
    rundb::RunDbReader reader(path);
    start_partial(out, layer_count);
    for (auto& v : out.samples) v.reserve(reserve);
    reader.for_each_sample_blob(first, last, [&](std::int64_t step, const std::vector<rundb::SampleRecord>& records) {
      if (step < 0 || step > kMaxStep)
        rundb::throw_corrupt(path, "grad_samples has step " + std::to_string(step) + " (a run.db numbers them from 0 to 2^31-1)");
      bool nonfinite = false;
      for (const auto& r : records) {
        if (r.layer_id >= layer_count) unknown_layer(path, "grad_samples", r.layer_id, layer_count);
        add_sample(out, step, r);
        nonfinite |= r.nonfinite != 0;
      }
      if (nonfinite) nonfinite_steps.push_back(step);
      out.rows += std::int64_t(records.size());
      progress.fetch_add(std::int64_t(records.size()), std::memory_order_relaxed);
    });
  } catch (const std::exception& e) {
    out.error = e.what();
  }
}

// Runs `work(t)` on n threads, reporting progress every 100 ms until all end. `work`
// keeps its errors in its Partial: it never throws.
template <typename Work>
void run_parallel(int n, const LoadOptions& options, std::atomic<std::int64_t>& progress, std::int64_t estimate, Work work) {
  std::atomic<int> finished{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < n; ++t)
    workers.emplace_back([&, t] {
      work(t);
      finished.fetch_add(1);
    });
  while (options.progress && finished.load() < n) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    options.progress(progress.load(), estimate);
  }
  for (auto& w : workers) w.join();
}

// Consecutive steps as [first, last] ranges.
std::vector<std::pair<std::int64_t, std::int64_t>> step_ranges(std::vector<std::int64_t> steps) {
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (const std::int64_t s : steps) {
    if (!out.empty() && out.back().second + 1 == s)
      out.back().second = s;
    else
      out.push_back({s, s});
  }
  return out;
}

bool process_alive(const std::string& pid_text) {
  const long pid = std::atol(pid_text.c_str());
  return pid > 0 && (::kill(pid_t(pid), 0) == 0 || errno == EPERM);
}

}  // namespace

std::string Run::meta_or(const std::string& key, const std::string& fallback) const {
  const auto it = meta.find(key);
  return it == meta.end() ? fallback : it->second;
}

double Run::init_scale() const { return std::atof(meta_or("scaler_init_scale", "65536").c_str()); }

bool Run::loss_known(const rundb::StepRow& row) const {
  if (row.losses >= 0) return row.losses > 0;
  // Format 1 stored NULL for a NaN loss and for one never seen; only the scaler recorded it.
  return std::isfinite(row.loss) || has_scaler();
}

const rundb::ReplayRow* Run::replay_of(const std::string& module) const {
  for (const auto& r : replays)
    if (r.module == module) return &r;
  return nullptr;
}

const ModuleSummary* Run::module_named(const std::string& path) const {
  for (const auto& m : modules)
    if (m.info.path == path) return &m;
  return nullptr;
}

double headroom_bits(double absmax, double fp_max) {
  if (!(absmax > 0.0)) return INFINITY;
  return std::log2(fp_max / absmax);
}

Run load_run(const std::string& path, const LoadOptions& options) {
  rundb::RunDbReader reader(path);  // validates identity and version, one clear line if not
  Run run;
  run.path = path;
  run.meta = reader.meta();
  run.finished = reader.finished();
  if (!run.finished && !options.allow_unfinished) {
    const std::string write_error = run.meta_or("write_error", "");
    if (!write_error.empty())
      throw rundb::RunDbError(path + ": writing it failed during training (" + write_error + "); " +
                              run.meta_or("lost_records", "?") +
                              " records were lost; pass --allow-partial to report on the steps written before");
    const std::string pid = run.meta_or("pid", "");
    const bool alive = !pid.empty() && process_alive(pid);
    throw rundb::RunDbError(path + (alive ? ": still being written by process " + pid
                                          : ": was not closed (its training process stopped or was killed)") +
                            "; pass --allow-partial to report on what it holds so far");
  }
  run.rank = std::atoll(run.meta_or("rank", "0").c_str());
  run.world_size = std::atoll(run.meta_or("world_size", "1").c_str());
  run.run_id = run.meta_or("run_id", "");
  run.fp_max = run.meta_or("amp_dtype", "float16") == "bfloat16" ? 3.3895313892515355e38 : 65504.0;
  try {
    for (auto& row : reader.steps()) run.steps.push_back({row, {}, -1});
    for (auto& row : reader.layers()) run.layers.push_back({row, {}, 0, 0, 0.0, -1, {}});
    for (auto& row : reader.modules()) run.modules.push_back({row, 0, 0, -1, 0.0f});
    run.events = reader.events();
    run.replays = reader.replays();
  } catch (const rundb::RunDbError& e) {
    throw rundb::RunDbError(std::string(e.what()) + " (truncated or corrupted?)");
  }
  if (run.steps.empty())
    throw rundb::RunDbError(path + ": holds no steps (the training never reached scaler.update())");
  if (run.steps.front().row.step < 0 || run.steps.back().row.step > kMaxStep)
    rundb::throw_corrupt(path, "steps are numbered from " + std::to_string(run.steps.front().row.step) + " to " +
                      std::to_string(run.steps.back().row.step) + " (a run.db numbers them from 0 to 2^31-1)");
  for (std::size_t i = 0; i < run.layers.size(); ++i)
    if (run.layers[i].info.id != std::int64_t(i)) throw rundb::RunDbError(path + ": layer ids are not dense: corrupted");
  for (std::size_t i = 0; i < run.modules.size(); ++i)
    if (run.modules[i].info.id != std::int64_t(i)) throw rundb::RunDbError(path + ": module ids are not dense: corrupted");

  // Gradient statistics, in parallel: from the writer's summaries where the file has them,
  // else by scanning grad_stats over step ranges.
  std::int64_t first = 0, last = -1;
  const bool any_grad = reader.grad_step_range(first, last);
  if (any_grad && (first < 0 || last > kMaxStep))
    rundb::throw_corrupt(path, "grad_stats has steps from " + std::to_string(first) + " to " + std::to_string(last) +
                      " (a run.db numbers them from 0 to 2^31-1)");
  const bool histograms = run.meta_or("histogram", "0") == "1";
  const int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const std::size_t layer_count = run.layers.size();
  std::vector<Partial> parts;
  std::atomic<std::int64_t> progress{0};
  const std::int64_t estimate = (last - first + 1) * std::int64_t(std::max<std::size_t>(1, layer_count));
  std::int64_t first_id = 0, last_id = -1;
  if (any_grad && reader.has_summaries() && !options.full_scan) {
    if (reader.sample_id_range(first_id, last_id)) {
      const std::int64_t span = last_id - first_id + 1;
      const int n = int(std::min<std::int64_t>(threads, span));
      parts.resize(std::size_t(n));
      std::vector<std::vector<std::int64_t>> nonfinite(static_cast<std::size_t>(n));
      // The first part takes the others in when merged: it reserves room for every step.
      const std::int64_t step_count = last - first + 1;
      run_parallel(n, options, progress, estimate, [&](int t) {
        const std::size_t reserve = std::size_t(t == 0 ? step_count : step_count / n) + 16;
        read_summaries(path, first_id + span * t / n, first_id + span * (t + 1) / n - 1, layer_count, reserve,
                       parts[std::size_t(t)], nonfinite[std::size_t(t)], progress);
      });
      for (const auto& p : parts)
        if (!p.error.empty()) throw rundb::RunDbError(p.error);
      // Which layer went non-finite first needs the backward order: read those steps whole.
      std::vector<std::int64_t> steps;
      for (const auto& list : nonfinite) steps.insert(steps.end(), list.begin(), list.end());
      const auto ranges = step_ranges(std::move(steps));
      const int m = int(std::min<std::size_t>(std::size_t(threads), ranges.size()));
      std::vector<Partial> order(static_cast<std::size_t>(m));
      run_parallel(m, LoadOptions{}, progress, estimate, [&](int t) {
        std::vector<std::pair<std::int64_t, std::int64_t>> mine;
        for (std::size_t i = std::size_t(t); i < ranges.size(); i += std::size_t(m)) mine.push_back(ranges[i]);
        scan_ranges(path, mine, layer_count, {false, false, true}, order[std::size_t(t)], progress);
      });
      for (auto& p : order) parts.push_back(std::move(p));
    }
    if (histograms) {
      // The written sums, and grad_stats' histograms of the steps after them.
      std::map<std::int64_t, std::vector<std::uint64_t>> sums;
      const std::int64_t covered = reader.histogram_sums(sums);
      Partial tail;
      if (covered < last) scan_ranges(path, {{covered + 1, last}}, layer_count, {false, true, false}, tail, progress);
      else start_partial(tail, layer_count);
      if (!tail.error.empty()) throw rundb::RunDbError(tail.error);
      for (auto& [layer, counts] : sums) {
        if (layer < 0 || std::size_t(layer) >= layer_count) unknown_layer(path, "grad_hist_sums", layer, layer_count);
        auto& sum = tail.histogram[std::size_t(layer)];
        sum.resize(counts.size(), 0);
        for (std::size_t b = 0; b < counts.size(); ++b) sum[b] += counts[b];
      }
      parts.push_back(std::move(tail));
    }
  } else if (any_grad) {
    const std::int64_t span = last - first + 1;
    const int n = int(std::min<std::int64_t>(threads, span));
    parts.resize(std::size_t(n));
    run_parallel(n, options, progress, estimate, [&](int t) {
      scan_ranges(path, {{first + span * t / n, first + span * (t + 1) / n - 1}}, layer_count, {true, histograms, true},
                  parts[std::size_t(t)], progress);
    });
  }
  for (const auto& p : parts)
    if (!p.error.empty()) throw rundb::RunDbError(p.error);

  std::map<std::int64_t, std::size_t> step_index;
  for (std::size_t i = 0; i < run.steps.size(); ++i) step_index[run.steps[i].row.step] = i;
  for (auto& p : parts) {
    run.grad_rows += p.rows;
    for (std::size_t l = 0; l < p.samples.size(); ++l) {
      LayerSummary& layer = run.layers[l];
      if (layer.samples.empty()) layer.samples = std::move(p.samples[l]);
      else layer.samples.insert(layer.samples.end(), p.samples[l].begin(), p.samples[l].end());
      const auto [amin, at] = p.least_nonzero[l];
      if (at >= 0 && (layer.least_nonzero_step < 0 || amin < layer.least_nonzero))
        layer.least_nonzero = amin, layer.least_nonzero_step = at;
      if (!p.histogram[l].empty()) {
        layer.histogram.resize(p.histogram[l].size(), 0);
        for (std::size_t b = 0; b < p.histogram[l].size(); ++b) layer.histogram[b] += p.histogram[l][b];
      }
    }
    for (auto& [step, list] : p.nonfinite) {
      std::sort(list.begin(), list.end());
      const auto it = step_index.find(step);
      for (const auto& [order, layer] : list) run.layers[std::size_t(layer)].nonfinite_steps += 1;
      if (it == step_index.end()) continue;  // a step row not committed yet
      StepSummary& s = run.steps[it->second];
      for (const auto& [order, layer] : list) s.nonfinite_layers.push_back(layer);
      const auto before = p.last_finite_before.find(step);
      if (before != p.last_finite_before.end()) s.last_finite_before = before->second;
      if (s.row.skipped && !list.empty()) run.layers[std::size_t(list.front().second)].first_nonfinite += 1;
    }
  }

  // Summaries are in the order the writer committed them: a step written late sorts in.
  const auto by_step = [](const GradSample& a, const GradSample& b) { return a.step < b.step; };
  for (auto& layer : run.layers)
    if (!std::is_sorted(layer.samples.begin(), layer.samples.end(), by_step))
      std::stable_sort(layer.samples.begin(), layer.samples.end(), by_step);

  // Activation statistics: per step, the first module (forward order) with NaN/Inf.
  std::int64_t current = -1;
  bool found_in_step = false;
  try {
    for (const auto& a : reader.act_stats()) {
      ++run.act_rows;
      if (a.module_id < 0 || std::size_t(a.module_id) >= run.modules.size())
        throw rundb::RunDbError(path + ": activation rows name unknown modules: corrupted");
      ModuleSummary& m = run.modules[std::size_t(a.module_id)];
      if (a.step != current) {
        current = a.step;
        found_in_step = false;
      }
      if (std::isfinite(a.stats.absmax)) m.max_absmax = std::max(m.max_absmax, float(a.stats.absmax));
      if (a.stats.nan + a.stats.inf == 0) continue;
      ++m.nonfinite_steps;
      if (found_in_step) continue;
      found_in_step = true;
      ++m.first_nonfinite;
      if (m.first_step < 0) m.first_step = a.step;
      const auto it = step_index.find(a.step);
      if (it != step_index.end()) run.steps[it->second].first_nonfinite_module = a.module_id;
    }
  } catch (const rundb::RunDbError& e) {
    const std::string what = e.what();
    throw rundb::RunDbError(what.find("corrupted") != std::string::npos ? what : what + " (truncated or corrupted?)");
  }
  return run;
}

}  // namespace ampdiag::analyzer
