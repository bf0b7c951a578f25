// load_run (refuses what it should not read, then one read_run_delta from the start) and
// the Run's own questions.
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

#include "ampdiag/analyzer/run.h"
#include "ampdiag/analyzer/run_delta.h"
#include "ampdiag/rundb/reader.h"
#include "rules.h"

namespace ampdiag::analyzer {

namespace {

// A process that was killed stays a zombie until its parent reaps it (a container whose init
// does not reap: seconds or more), and kill() still finds it; it writes nothing more.
bool zombie(long pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return false;
  const auto paren = text.rfind(')');  // the name before it may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < text.size() && (text[paren + 2] == 'Z' || text[paren + 2] == 'X');
}

bool process_alive(const std::string& pid_text) {
  const long pid = std::atol(pid_text.c_str());
  return pid > 0 && (::kill(pid_t(pid), 0) == 0 || errno == EPERM) && !zombie(pid);
}

void read_gpu_profile(rundb::RunDbReader& reader, Run& run) {
  std::int64_t last_step = INT64_MIN;
  for (const rundb::GpuTimeRow& r : reader.gpu_time()) {  // in step order
    if (r.step != last_step) ++run.gpu.steps;
    last_step = r.step;
    GpuTime& t = run.gpu.modules[r.module_id];
    t.ns[int(r.kind)] += r.ns;
    t.count[int(r.kind)] += r.count;
    run.gpu.phase_ns[int(r.phase)] += r.ns;
    run.gpu.total_ns += r.ns;
  }
}

void read_weight_updates(rundb::RunDbReader& reader, Run& run) {
  for (const rundb::WeightUpdateRow& r : reader.weight_updates()) {
    if (r.layer_id < 0 || std::size_t(r.layer_id) >= run.layers.size())
      throw rundb::RunDbError(run.path + ": weight_updates names layer " + std::to_string(r.layer_id) +
                              ", which the layers table does not hold (the file is damaged)");
    LayerSummary& layer = run.layers[std::size_t(r.layer_id)];
    if (layer.first_update_step < 0) layer.first_update_step = r.step;
    ++layer.update_steps;
    layer.update_nonzero += r.nonzero;
    layer.update_stalled += r.stalled;
  }
}

}  // namespace

std::int64_t GpuTime::kernel_ns() const {
  std::int64_t sum = 0;
  for (int k = 0; k < rundb::kGpuKindCount; ++k) sum += k == int(rundb::GpuKind::kMemcpy) ? 0 : ns[k];
  return sum;
}

std::string meta_or(const std::map<std::string, std::string>& meta, const std::string& key, const std::string& fallback) {
  const auto it = meta.find(key);
  return it == meta.end() ? fallback : it->second;
}

std::string Run::meta_or(const std::string& key, const std::string& fallback) const {
  return analyzer::meta_or(meta, key, fallback);
}

// Five or more calls with a finite |output| from the first to the one just before the NaN/Inf
// call, three in four of them above the one before, a hundredfold in all: a state amplified
// call after call, not one call's overflow after outputs that wandered.
bool CallGrowth::grows() const {
  const std::int64_t span = to_call - from_call;
  return from_call >= 0 && nonfinite_call == to_call + 1 && span >= 4 && rises * 4 >= span * 3 &&
         double(to) >= 100.0 * double(from) && rate() >= 1.05;
}

double CallGrowth::rate() const {
  const std::int64_t span = to_call - from_call;
  return span > 0 && from > 0.0f ? std::pow(double(to) / double(from), 1.0 / double(span)) : 1.0;
}

double Run::init_scale() const { return std::atof(meta_or("scaler_init_scale", "65536").c_str()); }

bool Run::input_nan(std::int64_t step) const {
  return std::binary_search(input_nan_steps.begin(), input_nan_steps.end(), step);
}

bool Run::output_gradient_nonfinite(std::int64_t step) const {
  return std::binary_search(output_gradient_steps.begin(), output_gradient_steps.end(), step);
}

bool Run::output_overflow_in_loss(std::int64_t step) const {
  return output_overflow_in_loss_code &&
         std::binary_search(output_overflow_steps.begin(), output_overflow_steps.end(), step);
}

bool Run::forward_dropped(std::int64_t step) const {
  return std::binary_search(forward_dropped_steps.begin(), forward_dropped_steps.end(), step);
}

bool Run::evaluation_nonfinite(std::int64_t step) const {
  return std::binary_search(evaluation_steps.begin(), evaluation_steps.end(), step);
}

bool Run::loss_known(const rundb::StepRow& row) const {
  if (row.losses >= 0) return row.losses > 0;
  // Format 1 stored NULL for a NaN loss and for one never seen; only the scaler recorded it.
  return std::isfinite(row.loss) || has_scaler();
}

bool Run::loss_nonfinite(const rundb::StepRow& row) const { return loss_known(row) && !std::isfinite(row.loss); }

const rundb::EventRow* Run::first_event(const std::string& kind) const {
  for (const auto& e : events)
    if (e.kind == kind) return &e;
  return nullptr;
}

const StepSummary* Run::step_summary(std::int64_t step) const {
  const auto it = std::lower_bound(steps.begin(), steps.end(), step,
                                   [](const StepSummary& s, std::int64_t v) { return s.row.step < v; });
  return it != steps.end() && it->row.step == step ? &*it : nullptr;
}

std::pair<const rundb::EventRow*, std::string> Run::module_event(const std::string& kind,
                                                                const std::string& module) const {
  const std::string prefix = module + ": ";
  for (const auto& e : events)
    if (e.kind == kind && e.detail.rfind(prefix, 0) == 0) return {&e, e.detail.substr(prefix.size())};
  return {nullptr, ""};
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

bool Run::finishes_at_or_after(const std::string& later, const std::string& earlier) const {
  const ModuleSummary* a = module_named(later);
  const ModuleSummary* b = module_named(earlier);
  if (!a || !b) return false;
  if (a->position >= 0 && b->position >= 0) return a->position >= b->position;
  return a->info.id >= b->info.id;
}

const ModuleSummary* Run::last_module(bool zeros) const {
  const ModuleSummary* last = nullptr;
  std::int64_t most = -1;
  for (const ModuleSummary& m : modules) {
    if (m.info.path.empty() || !(m.max_absmax > 0.0f || (zeros && m.zero_step >= 0))) continue;
    // The step the cursor is in has not ended yet: its last module so far counts too.
    const std::int64_t steps = m.last_steps + (m.info.id == cursor.act_step_last ? 1 : 0);
    if (steps >= most) {  // among equals, the latest to first finish
      most = steps;
      last = &m;
    }
  }
  return last;
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
  // The gradient and activation statistics: one read from the start, merged into the Run.
  apply_run_delta(run, read_run_delta(path, RunCursor{}, options));
  read_gpu_profile(reader, run);
  read_weight_updates(reader, run);
  if (run.steps.empty()) {
    // The Python agent saw backwards but never the attached scaler (another one was used).
    if (const rundb::EventRow* e = run.first_event("scaler-unused"))
      throw rundb::RunDbError(path + ": holds no steps: " + e->detail);
    if (const rundb::EventRow* e = run.first_event("training-raised")) {
      const std::string fix = rules::raised_fix(run, e->detail);
      const bool stop = !e->detail.empty() && e->detail.back() == '.';
      throw rundb::RunDbError(path + ": holds no steps: before its first step was recorded, the training raised " +
                              e->detail + (fix.empty() ? "" : (stop ? " " : ". ") + fix));
    }
    throw rundb::RunDbError(path + ": holds no steps (the training never reached " +
                            (run.has_scaler() ? "scaler.update())" : "the optimizer's step())"));
  }
  return run;
}

}  // namespace ampdiag::analyzer
