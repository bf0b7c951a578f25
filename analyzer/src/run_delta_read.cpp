// read_run_delta: what a run.db holds beyond a cursor. From an empty cursor (load_run) the
// gradient statistics are read in parallel, one RunDbReader per thread: from the writer's
// summaries where the file has them, else by scanning grad_stats over step ranges (a 10 M
// row run needs ~2.3 s on one thread). From a cursor, one reader reads the rows after it
// in one snapshot of the file.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <thread>

#include "ampdiag/analyzer/run_delta.h"
#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/samples.h"
#include "histogram_counts.h"

namespace ampdiag::analyzer {

namespace {

using rundb::RunDbReader;

// Steps are stored as int32 in memory (GradSample); the agent numbers them from 0.
constexpr std::int64_t kMaxStep = INT32_MAX;

// What a scan of grad_stats gathers: a full scan everything; with the writer's summaries
// only the backward order of the steps that went non-finite, and the histograms of the
// steps after the last written sums.
struct ScanWhat {
  bool samples = true;     // GradSamples and the least non-zero |g|
  bool histograms = true;  // per-layer sums of finite rows' histograms
  bool order = true;       // non-finite layers in backward order, and the finite one before
  // Only these rows' histograms, as (step, layer) (null: every row's).
  const std::set<std::pair<std::int64_t, std::int64_t>>* histograms_of = nullptr;
};

void add_sample(GradPart& out, std::int64_t step, const rundb::SampleRecord& r) {
  const std::size_t layer = r.layer_id;
  if (!r.nonfinite) {
    auto& least = out.least_nonzero[layer];
    if (r.amin_nz > 0 && (least.second < 0 || r.amin_nz < least.first)) least = {r.amin_nz, step};
  }
  out.samples[layer].push_back({std::int32_t(step), r.absmax, r.l2, r.zero_q, r.nonfinite, r.sub_q});
}

void start_part(GradPart& out, std::size_t layer_count) {
  out.samples.assign(layer_count, {});
  out.least_nonzero.assign(layer_count, {0.0, -1});
  out.histogram.assign(layer_count, {});
}

[[noreturn]] void unknown_layer(const std::string& path, const char* table, std::int64_t layer, std::size_t layer_count) {
  rundb::throw_corrupt(path, std::string(table) + " has a row for layer " + std::to_string(layer) +
                                 ", but the layers table has ids 0 to " + std::to_string(std::int64_t(layer_count) - 1));
}

void check_step(const std::string& path, const char* table, std::int64_t step) {
  if (step < 0 || step > kMaxStep)
    rundb::throw_corrupt(path, std::string(table) + " has step " + std::to_string(step) +
                                   " (a run.db numbers them from 0 to 2^31-1)");
}

void scan_ranges(RunDbReader& reader, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, std::size_t layer_count,
                 ScanWhat what, GradPart& out, std::atomic<std::int64_t>& progress) {
  start_part(out, layer_count);
  // This step's finite rows as (bwd_order, layer): once the step ends, the one just
  // before its first non-finite gradient is kept.
  std::int64_t row_step = -1;
  std::vector<std::pair<std::int64_t, std::int64_t>> finite_rows;
  StepOrder* nonfinite_step = nullptr;  // row_step's entry, once one of its rows is non-finite
  std::int64_t kept_before = 0;         // steps given their finite_before
  auto close_step = [&] {
    if (nonfinite_step) {
      const std::int64_t first = std::min_element(nonfinite_step->nonfinite.begin(), nonfinite_step->nonfinite.end())->first;
      const bool keep = kept_before < StepOrder::kFiniteBeforeSteps;
      std::pair<std::int64_t, std::int64_t> best{-1, -1};
      for (const auto& r : finite_rows) {
        if (r.first >= first) continue;
        if (r.first > best.first) best = r;
        if (keep) nonfinite_step->finite_before.push_back(r.second);
      }
      nonfinite_step->last_finite_before = best.second;
      kept_before += keep && !nonfinite_step->finite_before.empty();
    }
    finite_rows.clear();
    nonfinite_step = nullptr;
  };
  auto visit = [&](const rundb::GradStatRow& g) {
    const std::int64_t step = g.step, layer = g.layer_id;
    if (layer < 0 || std::size_t(layer) >= layer_count) unknown_layer(reader.path(), "grad_stats", layer, layer_count);
    if (step != row_step) {
      close_step();
      row_step = step;
    }
    const bool nonfinite = (g.stats.nan | g.stats.inf) != 0;
    if (what.samples) add_sample(out, step, rundb::make_sample_record(g));
    if (what.histograms && !nonfinite && (!what.histograms_of || what.histograms_of->count({step, layer})))
      add_counts(out.histogram[std::size_t(layer)], g.histogram);
    if (what.order) {
      if (nonfinite) {
        if (!nonfinite_step) nonfinite_step = &out.order[step];
        const std::int64_t order = g.bwd_order < 0 ? StepOrder::kUnordered : g.bwd_order;
        nonfinite_step->nonfinite.push_back({order, layer});
      } else if (g.bwd_order >= 0) {
        finite_rows.push_back({g.bwd_order, layer});
      }
    }
    if (what.samples && (++out.rows & 0xffff) == 0) progress.fetch_add(0x10000, std::memory_order_relaxed);
  };
  for (const auto& [first, last] : ranges) {
    RunDbReader::GradScan scan;
    scan.first = first, scan.last = last, scan.histograms = what.histograms;
    reader.for_each_grad_stat(visit, scan);
    close_step();
  }
}

// The writer's summaries, rows first..last of grad_samples: the samples, the least
// non-zero |g|, and which steps went non-finite (their order is read from grad_stats).
// `reserve`: samples to expect per layer (reserved, not touched: growing vectors of a
// 50 M-row run by doubling would copy and fault in twice the memory).
// `rows`, if given, gains each record's (step, layer).
void read_summaries(RunDbReader& reader, std::int64_t first, std::int64_t last, std::size_t layer_count, std::size_t reserve,
                    GradPart& out, std::vector<std::int64_t>& nonfinite_steps, std::atomic<std::int64_t>& progress,
                    std::set<std::pair<std::int64_t, std::int64_t>>* rows = nullptr) {
  start_part(out, layer_count);
  for (auto& v : out.samples) v.reserve(reserve);
  reader.for_each_sample_blob(first, last, [&](std::int64_t step, const std::vector<rundb::SampleRecord>& records) {
    check_step(reader.path(), "grad_samples", step);
    bool nonfinite = false;
    for (const auto& r : records) {
      if (r.layer_id >= layer_count) unknown_layer(reader.path(), "grad_samples", r.layer_id, layer_count);
      add_sample(out, step, r);
      nonfinite |= r.nonfinite != 0;
      if (rows) rows->insert({step, std::int64_t(r.layer_id)});
    }
    if (nonfinite) nonfinite_steps.push_back(step);
    out.rows += std::int64_t(records.size());
    progress.fetch_add(std::int64_t(records.size()), std::memory_order_relaxed);
  });
}

// Runs `work(t)` on n threads, each with a reader of its own (a connection is never
// shared), reporting progress every 100 ms until all end. What a thread throws is kept in
// parts[t].error.
template <typename Work>
void run_parallel(const std::string& path, std::vector<GradPart>& parts, const LoadOptions& options,
                  std::atomic<std::int64_t>& progress, std::int64_t estimate, Work work) {
  const int n = int(parts.size());
  std::atomic<int> finished{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < n; ++t)
    workers.emplace_back([&, t] {
      try {
        RunDbReader reader(path);
        work(reader, t);
      } catch (const std::exception& e) {
        parts[std::size_t(t)].error = e.what();
      }
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

void throw_failed(const std::vector<GradPart>& parts) {
  for (const auto& p : parts)
    if (!p.error.empty()) throw rundb::RunDbError(p.error);
}

// Reading the tables other than the statistics failed: a short table is damage too.
[[noreturn]] void rethrow_damaged(const rundb::RunDbError& e) {
  const std::string what = e.what();
  throw rundb::RunDbError(what.find("corrupted") != std::string::npos ? what : what + " (truncated or corrupted?)");
}

// The rows of a dense id table beyond the `known` first ones; false when ids are not dense
// or fewer than known (not the file the cursor read).
template <typename Row>
bool rows_after(std::vector<Row> all, std::size_t known, const std::string& path, const char* what, std::vector<Row>& out) {
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i].id != std::int64_t(i)) throw rundb::RunDbError(path + ": " + what + " ids are not dense: corrupted");
  if (all.size() < known) return false;
  out.assign(std::make_move_iterator(all.begin() + std::ptrdiff_t(known)), std::make_move_iterator(all.end()));
  return true;
}

RunDelta reload() {
  RunDelta d;
  d.reload = true;
  return d;
}

// Gradient statistics of a whole file, in parallel (load_run).
void read_all_grads(RunDbReader& reader, const LoadOptions& options, std::size_t layer_count, bool histograms, RunDelta& d) {
  const std::string& path = reader.path();
  std::int64_t first = 0, last = -1;
  if (!reader.grad_step_range(first, last)) return;
  if (first < 0 || last > kMaxStep)
    rundb::throw_corrupt(path, "grad_stats has steps from " + std::to_string(first) + " to " + std::to_string(last) +
                                   " (a run.db numbers them from 0 to 2^31-1)");
  const int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<std::int64_t> progress{0};
  const std::int64_t estimate = (last - first + 1) * std::int64_t(std::max<std::size_t>(1, layer_count));
  std::vector<GradPart>& parts = d.grads;
  if (!reader.has_summaries() || options.full_scan) {
    const std::int64_t span = last - first + 1;
    parts.resize(std::size_t(std::min<std::int64_t>(threads, span)));
    const int n = int(parts.size());
    run_parallel(path, parts, options, progress, estimate, [&](RunDbReader& own, int t) {
      scan_ranges(own, {{first + span * t / n, first + span * (t + 1) / n - 1}}, layer_count, {true, histograms, true},
                  parts[std::size_t(t)], progress);
    });
    throw_failed(parts);
    if (histograms) {
      d.histograms.assign(layer_count, {});
      for (const auto& p : parts)
        for (std::size_t l = 0; l < layer_count; ++l) add_counts(d.histograms[l], p.histogram[l]);
    }
    return;
  }
  std::int64_t first_id = 0, last_id = -1;
  if (reader.sample_id_range(first_id, last_id)) {
    d.next.last_sample_id = last_id;
    const std::int64_t span = last_id - first_id + 1;
    const int n = int(std::min<std::int64_t>(threads, span));
    parts.resize(std::size_t(n));
    std::vector<std::vector<std::int64_t>> nonfinite(static_cast<std::size_t>(n));
    // The first part takes the others in when merged: it reserves room for every step.
    const std::int64_t step_count = last - first + 1;
    run_parallel(path, parts, options, progress, estimate, [&](RunDbReader& own, int t) {
      const std::size_t reserve = std::size_t(t == 0 ? step_count : step_count / n) + 16;
      read_summaries(own, first_id + span * t / n, first_id + span * (t + 1) / n - 1, layer_count, reserve, parts[std::size_t(t)],
                     nonfinite[std::size_t(t)], progress);
    });
    throw_failed(parts);
    // Which layer went non-finite first needs the backward order: read those steps whole.
    std::vector<std::int64_t> steps;
    for (const auto& list : nonfinite) steps.insert(steps.end(), list.begin(), list.end());
    const auto ranges = step_ranges(std::move(steps));
    std::vector<GradPart> order(std::min<std::size_t>(std::size_t(threads), ranges.size()));
    const std::size_t m = order.size();
    run_parallel(path, order, LoadOptions{}, progress, estimate, [&](RunDbReader& own, int t) {
      std::vector<std::pair<std::int64_t, std::int64_t>> mine;
      for (std::size_t i = std::size_t(t); i < ranges.size(); i += m) mine.push_back(ranges[i]);
      scan_ranges(own, mine, layer_count, {false, false, true}, order[std::size_t(t)], progress);
    });
    throw_failed(order);
    for (auto& p : order) parts.push_back(std::move(p));
  }
}

// The layers' histograms: the writer's sums, and grad_stats' histograms of the steps
// after them (at most ~65 k rows and a step: the writer sums that often).
void read_histograms(RunDbReader& reader, std::size_t layer_count, RunDelta& d) {
  std::int64_t first = 0, last = -1;
  if (!reader.grad_step_range(first, last)) return;
  std::map<std::int64_t, std::vector<std::uint64_t>> sums;
  const std::int64_t covered = reader.histogram_sums(sums);
  GradPart tail;
  std::atomic<std::int64_t> progress{0};
  if (covered < last) scan_ranges(reader, {{covered + 1, last}}, layer_count, {false, true, false}, tail, progress);
  else start_part(tail, layer_count);
  for (auto& [layer, counts] : sums) {
    if (layer < 0 || std::size_t(layer) >= layer_count) unknown_layer(reader.path(), "grad_hist_sums", layer, layer_count);
    add_counts(tail.histogram[std::size_t(layer)], counts);
  }
  d.histograms = std::move(tail.histogram);
}

// The summaries written after the cursor; the backward order of the steps that went
// non-finite, and the histograms of the rows summarised (which may be part of a step: a
// step can be split between two commits), from grad_stats. `least_step` becomes the first
// step they hold. False: the file holds fewer summaries than the cursor read (not the file
// it read).
bool read_new_grads(RunDbReader& reader, const RunCursor& from, std::size_t layer_count, bool histograms, RunDelta& d,
                    std::int64_t& least_step) {
  std::int64_t first_id = 0, last_id = 0;
  if (!reader.sample_id_range(first_id, last_id)) last_id = 0;
  if (last_id < from.last_sample_id) return false;
  if (last_id == from.last_sample_id) return true;
  d.next.last_sample_id = last_id;
  std::atomic<std::int64_t> progress{0};
  d.grads.resize(2);
  std::vector<std::int64_t> nonfinite, steps;
  std::set<std::pair<std::int64_t, std::int64_t>> rows;
  read_summaries(reader, std::max(first_id, from.last_sample_id + 1), last_id, layer_count, 0, d.grads[0], nonfinite, progress,
                 &rows);
  for (const auto& [step, layer] : rows)
    if (steps.empty() || steps.back() != step) steps.push_back(step);
  if (!steps.empty()) least_step = steps.front();
  ScanWhat what{false, histograms, true, &rows};
  scan_ranges(reader, step_ranges(histograms ? std::move(steps) : std::move(nonfinite)), layer_count, what, d.grads[1], progress);
  if (histograms) d.histograms = std::move(d.grads[1].histogram);
  return true;
}

// Steps whose forwards have a row for every call are the multiples of this: on the CPU an
// agent that samples activations writes the other steps' rows only for outputs that held
// NaN/Inf (FORMAT.md, act_stats). 1: every step (files without meta activation_every,
// device outputs).
std::int64_t full_forward_every(const std::map<std::string, std::string>& meta) {
  const auto number = [&](const char* key) -> std::int64_t {
    const std::string text = meta_or(meta, key, "");
    char* end = nullptr;
    const long long n = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
    return end != nullptr && *end == '\0' && n > 0 && n < (1LL << 31) ? n : 0;
  };
  const std::int64_t activation = number("activation_every");
  if (activation == 0 || meta_or(meta, "device", "cpu") != "cpu") return 1;
  return std::max<std::int64_t>(1, number("every")) * activation;
}

// Counts one more call of a module in a forward, whose output's statistics are `st`.
void count_call(CallGrowth& g, const rundb::StatValues& st) {
  const std::int64_t call = g.calls++;
  if (g.nonfinite_call >= 0) return;
  if (st.nan + st.inf > 0) {
    g.nonfinite_call = call;
    return;
  }
  if (!std::isfinite(st.absmax) || !(st.absmax > 0.0)) return;
  const float out = float(st.absmax);
  if (g.from_call < 0) {
    g.from_call = call;
    g.from = out;
  } else if (out > g.to) {
    ++g.rises;
  }
  g.to_call = call;
  g.to = out;
}

// Activation rows after the cursor: per step, the first module (forward order) with NaN/Inf;
// and in forwards with a row for every call, the module that finished last, the one before
// each step's first NaN/Inf, jumps over the modules before, and each module's calls in the
// forward where it was first. Returns the first step they hold (INT64_MAX: none).
std::int64_t read_acts(RunDbReader& reader, const RunCursor& from, std::size_t module_count, RunDelta& d) {
  const std::int64_t full_every = full_forward_every(d.meta);
  std::int64_t current = from.act_key.first, least_step = INT64_MAX, last_in_step = from.act_step_last;
  std::int64_t micro_batch = from.act_micro_batch;
  float forward_max = from.act_forward_max;
  std::int64_t calls = from.act_forward_calls;
  const std::int64_t root = d.next.root_module;
  bool found_in_step = from.act_step_found;
  std::vector<RunCursor::Calls> calls_of(module_count);  // in the current full forward
  for (const auto& [id, c] : from.act_calls)
    if (id >= 0 && std::size_t(id) < module_count) calls_of[std::size_t(id)] = c;
  const std::string& path = reader.path();
  reader.for_each_act_stat(
      [&](const rundb::ActStatRow& a) {
        ++d.act_rows;
        least_step = std::min(least_step, a.step);
        if (a.module_id < 0 || std::size_t(a.module_id) >= module_count)
          throw rundb::RunDbError(path + ": activation rows name unknown modules: corrupted");
        d.next.act_key = {a.step, a.fwd_order};
        RunDelta::ModuleDelta& m = d.module_stats[a.module_id];
        if (a.step != current) {
          if (last_in_step >= 0) ++d.module_stats[last_in_step].last_steps;
          current = a.step;
          found_in_step = false;
          last_in_step = -1;
          forward_max = 0.0f;
          calls = 0;
        }
        // The module that finished just before this one in the same forward.
        const bool full = a.step % full_every == 0;
        const std::int64_t before = a.micro_batch == micro_batch ? last_in_step : -1;
        if (a.micro_batch != micro_batch) {
          forward_max = 0.0f;
          calls = 0;
        }
        micro_batch = a.micro_batch;
        RunCursor::Calls* own_calls = nullptr;
        if (full) {
          own_calls = &calls_of[std::size_t(a.module_id)];
          if (own_calls->growth.step != a.step || own_calls->growth.micro_batch != a.micro_batch)
            *own_calls = {CallGrowth{a.step, a.micro_batch}, false};
          count_call(own_calls->growth, a.stats);
          // The forward its growth was kept from: the record follows its later calls there (read
          // now, or where that forward began in an earlier read, carried by the cursor).
          if (own_calls->kept) m.growth = own_calls->growth;
        }
        if (a.module_id != root && full) {
          last_in_step = a.module_id;
          m.before_last = before;
          m.position = calls++;
        }
        if (std::isfinite(a.stats.absmax)) {
          const float out = float(a.stats.absmax);
          m.max_absmax = std::max(m.max_absmax, out);
          if (a.module_id != root && full) {
            if (forward_max > 0.0f && (m.jump_before == 0.0f || out / forward_max > m.jump_absmax / m.jump_before)) {
              m.jump_absmax = out;
              m.jump_before = forward_max;
            }
            forward_max = std::max(forward_max, out);
          }
        }
        if (a.stats.nan + a.stats.inf == 0) {
          if (a.stats.numel > 0 && a.stats.zeros == a.stats.numel && a.step >= m.zero_step) {
            m.zero_step = a.step;
            m.zero_numel = a.stats.numel;
          }
          if (a.stats.numel > 0 && std::isfinite(a.stats.l2)) {
            m.rms_sum += a.stats.l2 / std::sqrt(double(a.stats.numel));
            ++m.rms_rows;
          }
          return;
        }
        ++m.nonfinite_steps;
        if (found_in_step) return;
        found_in_step = true;
        ++m.first_nonfinite;
        if (m.first_step < 0) m.first_step = a.step;
        if (full && !m.before_known) {
          m.before_known = true;
          m.before_first = before;
        }
        if (full && m.growth.calls == 0) {
          own_calls->kept = true;
          m.growth = own_calls->growth;
        }
        d.first_nonfinite_module[a.step] = a.module_id;
      },
      from.act_key, false);
  d.next.act_step_found = found_in_step;
  d.next.act_step_last = last_in_step;
  d.next.act_micro_batch = micro_batch;
  d.next.act_forward_max = forward_max;
  d.next.act_forward_calls = calls;
  d.next.act_calls.clear();
  for (std::size_t id = 0; id < calls_of.size(); ++id)
    if (calls_of[id].growth.calls > 0 && calls_of[id].growth.step == current && calls_of[id].growth.micro_batch == micro_batch)
      d.next.act_calls[std::int64_t(id)] = calls_of[id];
  return least_step;
}

}  // namespace

RunDelta read_run_delta(const std::string& path, const RunCursor& from, const LoadOptions& options) {
  RunDbReader reader(path);  // validates identity and version, one clear line if not
  RunDbReader::Snapshot snapshot(reader);
  RunDelta d;
  d.meta = reader.meta();
  d.finished = reader.finished();
  const std::string run_id = meta_or(d.meta, "run_id", "");
  if (from.started && (!from.incremental || run_id != from.run_id || !reader.has_summaries())) return reload();
  d.next = from;
  d.next.pending_order.clear();
  d.next.pending_module.clear();
  d.next.started = true;
  d.next.incremental = reader.has_summaries() && !options.full_scan;
  d.next.run_id = run_id;
  try {
    if (!rows_after(reader.layers(), from.layers, path, "layer", d.layers) ||
        !rows_after(reader.modules(), from.modules, path, "module", d.modules))
      return reload();
    d.events = reader.events();
    d.replays = reader.replays();
    d.precision_checks = reader.precision_checks();
    d.weight_norms = reader.weight_norms();
  } catch (const rundb::RunDbError& e) {
    rethrow_damaged(e);
  }
  const std::size_t layer_count = from.layers + d.layers.size(), module_count = from.modules + d.modules.size();
  d.next.layers = layer_count;
  d.next.modules = module_count;
  for (std::size_t i = 0; i < d.modules.size() && d.next.root_module < 0; ++i)
    if (d.modules[i].path.empty()) d.next.root_module = std::int64_t(from.modules + i);

  const bool histograms = meta_or(d.meta, "histogram", "0") == "1";
  // Rows written late (the agent's context of steps before an overflow) can touch steps
  // whose rows were read already: those steps rows are read again.
  std::int64_t touched = INT64_MAX;
  if (!from.started) {
    read_all_grads(reader, options, layer_count, histograms, d);
    if (histograms && d.next.incremental) read_histograms(reader, layer_count, d);
  } else if (!read_new_grads(reader, from, layer_count, histograms, d, touched)) {
    return reload();
  }
  try {
    touched = std::min(touched, read_acts(reader, from, module_count, d));
    d.steps = reader.steps(from.started ? std::min(touched, from.last_step + 1) : INT64_MIN);
  } catch (const rundb::RunDbError& e) {
    rethrow_damaged(e);
  }
  if (!d.steps.empty() && (d.steps.front().step < 0 || d.steps.back().step > kMaxStep))
    rundb::throw_corrupt(path, "steps are numbered from " + std::to_string(d.steps.front().step) + " to " +
                                   std::to_string(d.steps.back().step) + " (a run.db numbers them from 0 to 2^31-1)");
  const auto added = std::count_if(d.steps.begin(), d.steps.end(), [&](const rundb::StepRow& r) { return r.step > from.last_step; });
  d.next.step_rows = from.step_rows + added;
  if (!d.steps.empty()) d.next.last_step = std::max(from.last_step, d.steps.back().step);
  // A step row written below the cursor since (not by the agent, which writes them in step
  // order) was not read: only a whole read sees it.
  if (from.started && reader.step_count() != d.next.step_rows) return reload();
  return d;
}

}  // namespace ampdiag::analyzer
