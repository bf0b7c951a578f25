// Session; see session.h.
#include "session.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <chrono>
#include <stdexcept>

#include "ampdiag/rundb/module_paths.h"
#include "sampling.h"

namespace ampdiag::agent {

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Shortest text that reads back as the same double (65536 -> "65536").
std::string number_text(double v) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  return std::string(buf, end);
}

bool host(const Device& d) { return d.type == DeviceType::kCpu; }

}  // namespace

const char* engine_name(EngineKind k) {
  switch (k) {
    case EngineKind::kCpu: return "cpu";
    case EngineKind::kCuda: return "cuda";
    case EngineKind::kNone: return "none";
  }
  return "?";
}

void apply_outcome(const DeviceOutcome& o, const double* v, StepOutcome& into) {
  if (o.fields & DeviceOutcome::kLoss) into.loss = v[0];
  if (o.fields & DeviceOutcome::kScaleBefore) into.scale_before = v[1];
  if (o.fields & DeviceOutcome::kScaleAfter) into.scale_after = v[2];
  if (o.fields & DeviceOutcome::kFoundInf) into.found_inf = v[3] != 0.0;
  if (o.fields & DeviceOutcome::kSkippedIsFoundInf) into.skipped = v[3] != 0.0;
}

Session::Session(SessionOptions options) : options_(std::move(options)), cpu_(options_.cpu) {
  (void)SamplingPolicy(options_.recorder.every, options_.recorder.context_steps);  // validates before any file
  if (options_.recorder.queue_capacity < 16) throw std::invalid_argument("queue_capacity must be at least 16 records");
  if (options_.recorder.max_waiting < 1) throw std::invalid_argument("max_waiting must be at least 1 step");
  if (options_.activation_every < 1 || options_.activation_every > INT64_MAX / options_.recorder.every)
    throw std::invalid_argument("activation_every must be >= 1 (full activation statistics on one recorded step in N), "
                                "and every * activation_every must fit in 64 bits");
  step_start_ns_ = now_ns();
}

Session::~Session() { close(); }

void Session::open(const std::string& db_path, const RankInfo& rank, const std::string& run_id) {
  if (recorder_) throw std::logic_error("Session::open: the run.db is already open");
  auto writer = std::make_unique<rundb::RunDbWriter>(db_path, options_.overwrite);
  recorder_ = std::make_unique<StepRecorder>(std::move(writer), options_.recorder);
  WriterThread& w = recorder_->writer();
  w.post_meta("rank", std::to_string(rank.rank));
  w.post_meta("world_size", std::to_string(rank.world_size));
  w.post_meta("run_id", run_id.empty() ? default_run_id(rank) : run_id);
  for (auto& [k, v] : early_meta_) w.post_meta(std::move(k), std::move(v));
  for (auto& row : early_layers_) w.post_layer(std::move(row));
  for (auto& row : early_modules_) w.post_module(std::move(row));
  for (auto& row : early_events_) w.post_event(std::move(row));
  early_meta_.clear();
  early_layers_.clear();
  early_modules_.clear();
  early_events_.clear();
  if (options_.profile) start_profiler();
}

void Session::start_profiler() {
  auto collector = std::make_unique<ProfileCollector>(options_.profiler_source ? options_.profiler_source()
                                                                               : profiler::make_cupti_source());
  const std::string why = collector->start();
  if (!why.empty()) {
    set_meta("profiler", "unavailable");
    event("profiler-unavailable", "device profiling is unavailable, training goes on without it: " + why);
    return;
  }
  set_meta("profiler", collector->source_name());
  profile_ = std::move(collector);
  recorder_->writer().set_gpu_source(profile_.get());
}

// --- registry --------------------------------------------------------------------------

template <class Row>
void Session::post(Row row, std::vector<Row>& early, void (WriterThread::*to)(Row)) {
  if (recorder_)
    (recorder_->writer().*to)(std::move(row));
  else
    early.push_back(std::move(row));
}

Session::Layer Session::add_layer(std::uintptr_t key, const LayerInfo& info) {
  const auto found = layer_ids_.find(key);
  if (found != layer_ids_.end()) {
    event_once("shared:" + info.name, "shared-parameter",
               info.name + " is the same tensor as layer " + std::to_string(found->second) +
                   "; its statistics are recorded once, under that layer");
    return {found->second, false};
  }
  const auto id = std::int64_t(layer_count_++);
  layer_ids_[key] = id;
  frozen_ += info.trainable ? 0 : 1;
  if (arrival_ && std::size_t(id) < arrival_capacity_) {
    arrival_[std::size_t(id)].store(-1, std::memory_order_relaxed);
    arrival_size_.store(std::size_t(id) + 1, std::memory_order_release);
  }
  std::string name = info.name;
  if (layer_names_.count(name)) {
    const std::string replacing = name + " (from step " + std::to_string(step()) + ")";
    name = replacing;
    for (int k = 2; layer_names_.count(name); ++k) name = replacing + " #" + std::to_string(k);
  }
  layer_names_.insert(name);
  module_paths_[id] = info.module_path;
  whole_ = whole_ ? rundb::common_module(*whole_, info.module_path) : info.module_path;
  post<rundb::LayerRow>({id, name, info.module_path, info.module_type, info.dtype, info.shape, info.numel,
                         info.trainable, info.source},
                        early_layers_, &WriterThread::post_layer);
  return {id, true, name};
}

std::string Session::origin_module() const {
  const auto [first, before] = origin_;
  const auto path_of = [&](std::int64_t id) {
    const auto found = module_paths_.find(id);
    return found == module_paths_.end() ? std::string() : found->second;
  };
  if (first < 0) return "";
  const std::string own = path_of(first);
  if (before < 0) return own;
  const std::string common = rundb::common_module(own, path_of(before));
  return common.empty() || common == whole_ ? own : common;
}

std::vector<std::string> Session::nonfinite_modules(std::size_t limit) const {
  std::vector<std::string> paths;
  const std::string named = origin_module();
  for (const auto& [at, id] : nonfinite_) {
    if (paths.size() >= limit) break;
    const auto found = module_paths_.find(id);
    if (found == module_paths_.end()) continue;
    const std::string& path = found->second;
    const bool inside = !named.empty() && rundb::common_module(path, named) == named;
    if (!path.empty() && !inside && std::find(paths.begin(), paths.end(), path) == paths.end()) paths.push_back(path);
  }
  return paths;
}

void Session::reset_arrival() {
  next_arrival_.store(0, std::memory_order_relaxed);
  backward_start_.store(0, std::memory_order_relaxed);
  const std::size_t size = arrival_size_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < size; ++i) arrival_[i].store(-1, std::memory_order_relaxed);
}

void Session::layers_done() {
  // Room for layers added later: a block grown or a head swapped in after attach.
  arrival_capacity_ = layer_count_ + std::max<std::size_t>(256, layer_count_);
  arrival_ = std::make_unique<std::atomic<std::int32_t>[]>(arrival_capacity_);
  arrival_size_.store(layer_count_, std::memory_order_release);
  reset_arrival();
  if (frozen_ > 0)
    event("frozen-parameters",
          std::to_string(frozen_) + " parameters do not require grad; they are listed but have no statistics");
}

Session::Layer Session::layer_of(std::uintptr_t key, const LayerInfo& foreign) {
  const auto found = layer_ids_.find(key);
  if (found != layer_ids_.end()) return {found->second, false};
  // Optimized but not a parameter of the model: a made-up name, and no hook, so no bwd_order.
  const auto id = std::int64_t(layer_count_++);
  layer_ids_[key] = id;
  const std::string name = "optimizer.param" + std::to_string(id);
  layer_names_.insert(name);
  post<rundb::LayerRow>({id, name, "", "", foreign.dtype, foreign.shape, foreign.numel, true, foreign.source},
                        early_layers_, &WriterThread::post_layer);
  event_once("foreign:" + std::to_string(id), "foreign-parameter",
             name + " is optimized but is not a parameter of the attached model");
  return {id, true, name};
}

std::int64_t Session::module_id(const std::string& path, const std::string& type, const std::string& source,
                                const std::string& inputs) {
  const auto found = module_ids_.find(path);
  if (found != module_ids_.end()) return found->second;
  const auto id = std::int64_t(module_ids_.size());
  module_ids_[path] = id;
  post<rundb::ModuleRow>({id, path, type, source, inputs}, early_modules_, &WriterThread::post_module);
  return id;
}

void Session::set_meta(const std::string& key, const std::string& value) {
  if (recorder_)
    recorder_->writer().post_meta(key, value);
  else
    early_meta_.emplace_back(key, value);
}

void Session::write_meta(const RunMeta& m) {
  set_meta("ampdiag_version", "0.1.0");
  set_meta("source", m.source);
  set_meta("torch_version", m.torch_version);
  set_meta("device", m.device);
  set_meta("amp_dtype", m.amp_dtype);
  set_meta("command_line", m.command_line);
  set_meta("pid", std::to_string(::getpid()));
  set_meta("every", std::to_string(options_.recorder.every));
  set_meta("context_steps", std::to_string(options_.recorder.context_steps));
  set_meta("fused_unscale", m.fused_unscale ? "1" : "0");
  set_meta("histogram", options_.histogram ? "1" : "0");
  set_meta("activation_every", std::to_string(options_.activation_every));
  set_meta("stats_isa", kernels::cpu_isa_name(cpu_.isa()));
  set_meta("scaler_enabled", m.has_scaler ? "1" : "0");
  if (m.has_scaler) {
    set_meta("scaler_init_scale", number_text(m.scaler_init_scale));
    set_meta("scaler_growth_factor", number_text(m.scaler_growth_factor));
    set_meta("scaler_backoff_factor", number_text(m.scaler_backoff_factor));
    set_meta("scaler_growth_interval", std::to_string(m.scaler_growth_interval));
  }
}

void Session::event(const std::string& kind, const std::string& detail) {
  post<rundb::EventRow>({step(), kind, detail, 0.0}, early_events_, &WriterThread::post_event);
}

void Session::event_once(const std::string& key, const std::string& kind, const std::string& detail,
                         std::optional<std::int64_t> at_step) {
  if (at_step && (*at_step < 0 || *at_step > step()))
    throw std::invalid_argument("event '" + kind + "': step " + std::to_string(*at_step) +
                                " is not one this run has reached (it is at step " + std::to_string(step()) + ")");
  if (!events_posted_.insert(key).second) return;
  post<rundb::EventRow>({at_step.value_or(step()), kind, detail, 0.0}, early_events_, &WriterThread::post_event);
}

void Session::replay(const std::string& module, const std::string& outcome, double fp32_absmax,
                     const std::string& reason) {
  if (outcome != "finite" && outcome != "nonfinite" && outcome != "intrinsic" && outcome != "unconfirmed")
    throw std::invalid_argument("replay outcome must be finite, nonfinite, intrinsic or unconfirmed, not '" + outcome + "'");
  if (recorder_) recorder_->writer().post_replay({step(), module, outcome, fp32_absmax, reason});
}

void Session::precision_check(const std::string& module, const std::string& dtype, std::int64_t numel,
                              double rel_error, std::int64_t zeroed, double fp32_absmax,
                              std::optional<std::int64_t> at_step) {
  if (at_step && (*at_step < 0 || *at_step > step()))
    throw std::invalid_argument("precision check of " + module + ": step " + std::to_string(*at_step) +
                                " is not one this run has reached (it is at step " + std::to_string(step()) + ")");
  if (numel <= 0 || zeroed < 0 || zeroed > numel)
    throw std::invalid_argument("precision check of " + module + ": " + std::to_string(zeroed) + " zeroed of " +
                                std::to_string(numel) + " values is not a count a comparison gives");
  if (!std::isfinite(rel_error) || rel_error < 0 || !std::isfinite(fp32_absmax) || fp32_absmax <= 0)
    throw std::invalid_argument("precision check of " + module +
                                ": relative error and FP32 abs-max must be finite, the abs-max above 0");
  if (recorder_)
    recorder_->writer().post_precision_check(
        {at_step.value_or(step()), module, dtype, numel, rel_error, zeroed, fp32_absmax});
}

void Session::weight_norm(std::int64_t layer, double l2, double absmax, std::optional<std::int64_t> at_step) {
  if (layer < 0 || std::size_t(layer) >= layer_count_)
    throw std::invalid_argument("weight_norm: no layer " + std::to_string(layer) + " is registered");
  if (at_step && (*at_step < 0 || *at_step > step()))
    throw std::invalid_argument("weight_norm: step " + std::to_string(*at_step) + " is not reached (now " +
                                std::to_string(step()) + ")");
  const rundb::WeightNormRow row{at_step.value_or(step()), layer, l2, absmax};
  if (!row.values_valid())
    throw std::invalid_argument("weight_norm: L2 " + std::to_string(l2) + " and abs-max " + std::to_string(absmax) +
                                " are not a parameter's norms");
  if (recorder_) recorder_->writer().post_weight_norm(row);
}

void Session::weight_norms(const std::int64_t* layers, const kernels::TensorRef* refs, std::size_t n) {
  if (n == 0) return;
  std::vector<kernels::TensorStats> stats(n);
  cpu_.compute(refs, n, stats.data(), nullptr);
  for (std::size_t i = 0; i < n; ++i)
    if (!stats[i].has_nonfinite()) weight_norm(layers[i], stats[i].l2, std::min<double>(stats[i].absmax, stats[i].l2));
}

void Session::weight_update(std::int64_t step, std::int64_t layer, std::int64_t nonzero, std::int64_t stalled) {
  if (layer < 0 || std::size_t(layer) >= layer_count_)
    throw std::invalid_argument("weight_update: no layer " + std::to_string(layer) + " is registered");
  const rundb::WeightUpdateRow row{step, layer, nonzero, stalled};
  // Checked here, on the caller's thread: the writer thread would refuse it too late.
  if (!row.counts_valid())
    throw std::invalid_argument("weight_update: " + std::to_string(stalled) + " stalled of " + std::to_string(nonzero) +
                                " elements is not a count");
  if (recorder_) recorder_->writer().post_weight_update(row);
}

std::int64_t Session::step() const { return recorder_ ? recorder_->step() : 0; }

// --- backward arrival -----------------------------------------------------------------------

// A layer's place is its first arrival in the last backward of the step that reached it:
// where a later backward reaches it again (a second loss's, given its own backward), a
// NaN/Inf that backward made reached it after that backward's own layers, though its
// first arrival in the step came before them. Within one backward the first arrival holds
// (the tied look places a tied weight where its NaN part arrived). Micro-batches of one
// model arrive in the same order each time, so theirs is unchanged.
void Session::backward_began() {
  backward_start_.store(next_arrival_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void Session::arrived(std::int64_t layer) {
  if (layer < 0 || std::size_t(layer) >= arrival_size_.load(std::memory_order_acquire)) return;
  const std::int32_t mine = next_arrival_.fetch_add(1, std::memory_order_relaxed);
  const std::int32_t start = backward_start_.load(std::memory_order_relaxed);
  std::atomic<std::int32_t>& place = arrival_[std::size_t(layer)];
  std::int32_t seen = place.load(std::memory_order_relaxed);
  while (seen < start && !place.compare_exchange_weak(seen, mine, std::memory_order_relaxed)) {
  }
}

std::int32_t Session::arrival(std::int64_t layer) const {
  if (layer < 0 || std::size_t(layer) >= arrival_size_.load(std::memory_order_acquire)) return -1;
  return arrival_[std::size_t(layer)].load(std::memory_order_relaxed);
}

// --- the cycle ----------------------------------------------------------------------------

bool Session::begin_cycle() {
  if (cycle_open_) return false;
  cycle_open_ = true;
  checked_ = false;
  if (recorder_) recorder_->begin_step();
  reset_arrival();
  if (profile_) {
    // Kernels and copies of the steps the regular sampling records; a range for the whole
    // cycle catches what runs outside every module (the loss, the scaler's update).
    const std::int64_t step = recorder_->step();
    profile_->begin_step(step, regular_sample(step, options_.recorder.every));
    step_range_ = profile_->begin_range(-1, rundb::GpuPhase::kOther, rundb::GpuKind::kOtherKernel);
  }
  return true;
}

bool Session::begin_range(std::int64_t module, rundb::GpuPhase phase, rundb::GpuKind hint) {
  return profile_ && profile_->begin_range(module, phase, hint);
}

void Session::end_range() {
  if (profile_) profile_->end_range();
}

EngineKind Session::engine_for(const Device& device) const {
  if (host(device)) return EngineKind::kCpu;
  if (device_engine_) return device_engine_->kind();
#ifdef AMPDIAG_HAVE_CUDA
  return EngineKind::kCuda;
#else
  return EngineKind::kNone;
#endif
}

const char* Session::device_label() const {
  return device_engine_ && device_engine_->kind() == EngineKind::kCuda ? "cuda" : "device";
}

bool Session::device_engine_ready(const Device& device) {
  if (!device_engine_) device_engine_ = make_cuda_engine();
  std::string why = device_engine_ ? device_engine_->unavailable() : "this ampdiag build has no CUDA engine";
  if (why.empty()) return true;
  event_once("no-engine", "slow-path",
             "tensors on " + std::string(device.type == DeviceType::kCuda ? "cuda" : "a device") +
                 " have no statistics: " + why + " (they are never copied to the host)");
  return false;
}

void Session::launch_on_device(const kernels::TensorRef* refs, std::size_t n, const DeviceLaunch& launch, LandAs as) {
  const bool ranged = begin_range(-1, rundb::GpuPhase::kAmpdiag, rundb::GpuKind::kOtherKernel);
  std::unique_ptr<Ticket> ticket = device_engine_->launch(refs, n, launch, std::move(as));
  if (ranged) end_range();
  if (ticket)
    recorder_->stage_ticket(std::move(ticket));
  else
    recorder_->mark_incomplete(device_label());
}

bool Session::grads(const GradBatch& b) {
  if (!recorder_) return false;
  begin_cycle();
  checked_ = true;
  const std::size_t n = b.count;
  bool found = false;

  // Host tensors: one pass now.
  refs_.clear();
  mrefs_.clear();
  ids_.clear();
  for (std::size_t i = 0; i < n; ++i) {
    const DeviceTensor& t = b.tensors[i];
    if (!host(t.device)) continue;
    ids_.push_back(b.layers[i]);
    if (b.unscale)
      mrefs_.push_back({const_cast<void*>(t.ref.data), t.ref.numel, t.ref.dtype});
    else
      refs_.push_back(t.ref);
  }
  if (!ids_.empty()) {
    const std::size_t k = ids_.size();
    stats_.resize(k);
    hist_.assign(options_.histogram ? k * kernels::kHistBins : 0, 0);
    std::uint64_t* hist = options_.histogram ? hist_.data() : nullptr;
    found = b.unscale ? cpu_.unscale_and_compute(mrefs_.data(), k, b.inv_scale, stats_.data(), hist)
                      : cpu_.compute(refs_.data(), k, stats_.data(), hist);
    for (std::size_t i = 0; i < k; ++i)
      recorder_->stage_grad(ids_[i], arrival(ids_[i]), stats_[i], hist ? hist + i * kernels::kHistBins : nullptr);
  }
  origin_ = {-1, -1};
  nonfinite_.clear();
  if (found) {  // as the analyzer orders a step's gradients: by (arrival, layer)
    for (std::size_t i = 0; i < ids_.size(); ++i)
      if (stats_[i].has_nonfinite()) nonfinite_.emplace_back(arrival(ids_[i]), ids_[i]);
    std::sort(nonfinite_.begin(), nonfinite_.end());
  }
  if (!nonfinite_.empty()) {
    std::pair<std::int32_t, std::int64_t> first = nonfinite_.front(), before{-1, -1};
    for (std::size_t i = 0; i < ids_.size(); ++i) {
      const std::int32_t at = arrival(ids_[i]);
      if (!stats_[i].has_nonfinite() && at < first.first && at > before.first) before = {at, ids_[i]};
    }
    origin_ = {first.second, before.second};
  }

  // Device tensors: one launch per (device, stream), in the optimizer's order.
  launched_.assign(n, 0);
  for (std::size_t first = 0; first < n; ++first) {
    const DeviceTensor& lead = b.tensors[first];
    if (host(lead.device) || launched_[first]) continue;
    if (!device_engine_ready(lead.device)) break;
    refs_.clear();
    LandAs as;
    for (std::size_t i = first; i < n; ++i) {
      const DeviceTensor& t = b.tensors[i];
      if (launched_[i] || !(t.device == lead.device) || t.stream != lead.stream) continue;
      launched_[i] = 1;
      refs_.push_back(t.ref);
      as.ids.push_back(b.layers[i]);
      as.orders.push_back(arrival(b.layers[i]));
    }
    DeviceLaunch launch;
    launch.device = lead.device;
    launch.stream = lead.stream;
    launch.histogram = options_.histogram;
    if (b.unscale) {
      launch.inv_scale = b.device_inv_scale;
      launch.found_inf = b.device_found_inf;
    }
    launch_on_device(refs_.data(), refs_.size(), launch, std::move(as));
  }
  return found;
}

bool Session::activation(std::int64_t module, const DeviceTensor& t, std::int32_t micro_batch) {
  if (!recorder_) return false;
  begin_cycle();
  const std::int32_t order = recorder_->next_forward_order();
  bool nonfinite = false;
  if (host(t.device)) {
    // Outside the full steps a finite output costs one max over its bits and leaves no row.
    const bool full = regular_sample(recorder_->step(), options_.recorder.every * options_.activation_every);
    if (!full && !cpu_.has_nonfinite(t.ref)) return false;
    kernels::TensorStats s;
    std::uint64_t* hist = nullptr;
    if (options_.histogram) {
      hist_.resize(kernels::kHistBins);
      hist = hist_.data();
    }
    cpu_.compute(&t.ref, 1, &s, hist);
    recorder_->stage_act(module, order, s, hist, micro_batch);
    nonfinite = s.has_nonfinite();
  } else if (device_engine_ready(t.device)) {
    DeviceLaunch launch;
    launch.device = t.device;
    launch.stream = t.stream;
    launch.histogram = options_.histogram;
    LandAs as;
    as.activation = true;
    as.ids = {module};
    as.orders = {order};
    as.micro_batch = micro_batch;
    launch_on_device(&t.ref, 1, launch, std::move(as));
  }
  return nonfinite;
}

std::unique_ptr<Ticket> Session::outcome_ticket(const DeviceOutcome& later) {
  if (host(later.device) || !device_engine_ready(later.device)) return nullptr;
  const bool ranged = begin_range(-1, rundb::GpuPhase::kAmpdiag, rundb::GpuKind::kOtherKernel);
  std::unique_ptr<Ticket> ticket = device_engine_->read_outcome(later);
  if (ranged) end_range();
  return ticket;
}

void Session::end_step(StepOutcome o, std::int64_t adapter_ns, const DeviceOutcome* later) {
  const std::int64_t now = now_ns();
  o.step_ns = now - step_start_ns_;
  o.agent_ns = agent_ns_ + adapter_ns;
  if (recorder_ && later) {
    if (std::unique_ptr<Ticket> ticket = outcome_ticket(*later))
      recorder_->stage_ticket(std::move(ticket));
    else
      recorder_->mark_incomplete(device_label());
  }
  if (step_range_) {
    profile_->end_range();
    step_range_ = false;
  }
  if (recorder_) recorder_->end_step(o);
  agent_ns_ = 0;
  step_start_ns_ = now;
  cycle_open_ = false;
  checked_ = false;
}

bool Session::amend_scale_after(double scale_after) {
  return recorder_ ? recorder_->amend_scale_after(scale_after) : false;
}

bool Session::amend_outcome(const DeviceOutcome& later) {
  if (!recorder_ || !recorder_->pending()) return false;
  std::unique_ptr<Ticket> ticket = outcome_ticket(later);
  return ticket && recorder_->amend_ticket(std::move(ticket));
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  // CUPTI's last buffers complete before the writer's last drain takes them.
  if (profile_) profile_->stop();
  if (recorder_) recorder_->close();
}

RecorderCounters Session::counters() const {
  RecorderCounters c;
  if (recorder_) c = recorder_->counters();
  if (!failure_.empty() && c.first_error.empty()) {
    c.write_errors += 1;
    c.first_error = failure_;
  }
  return c;
}

}  // namespace ampdiag::agent
