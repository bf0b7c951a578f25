// Agent: attaches to a model and a GradScaler, stages each step's statistics, decides
// what to record at update() and hands fixed-size records to the writer thread.
#include "ampdiag/agent.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/version.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "ampdiag/grad_scaler.h"
#include "ampdiag/kernels/cpu_stats.h"
#include "ampdiag/rundb/writer.h"
#include "run_paths.h"
#include "step_recorder.h"
#include "tensor_views.h"

namespace ampdiag {

namespace {

using Clock = std::chrono::steady_clock;

std::int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// "torch::nn::LinearImpl" -> "Linear"; user modules keep their own name.
std::string module_type_name(const torch::nn::Module& m) {
  std::string name = m.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

std::string shape_text(const at::Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : raw)
    if (c == '\0') c = ' ';
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

// Last-arrival bookkeeping shared with the gradient hooks, which may run on autograd's
// worker threads.
struct ArrivalOrder {
  explicit ArrivalOrder(std::size_t layers) : order(layers) { reset(); }
  void reset() {
    next.store(0, std::memory_order_relaxed);
    for (auto& o : order) o.store(-1, std::memory_order_relaxed);
  }
  void arrived(std::size_t layer) {
    std::int32_t expected = -1;
    const std::int32_t mine = next.fetch_add(1, std::memory_order_relaxed);
    order[layer].compare_exchange_strong(expected, mine, std::memory_order_relaxed);
  }
  std::atomic<std::int32_t> next{0};
  std::vector<std::atomic<std::int32_t>> order;
};

}  // namespace

class Agent::Impl final : public ScalerObserver {
 public:
  Impl(torch::nn::Module& model, GradScaler& scaler, AgentOptions options);
  ~Impl() override { close(); }

  at::Tensor probe(const std::string& path, const at::Tensor& x);
  void close();
  AgentStatus status() const;

  void on_scale(const at::Tensor& outputs) override;
  bool on_unscale(UnscaleBatch& batch) override;
  void on_step(bool skipped) override { skipped_ = skipped; }
  void on_update(double scale_before, double scale_after, bool found_inf) override;

 private:
  void register_layers(torch::nn::Module& model);
  std::int64_t layer_of(const at::Tensor& param);
  std::int64_t module_id(const std::string& path);
  void post_event_once(const std::string& key, const std::string& kind, const std::string& detail);
  void write_meta(const GradScaler& scaler);
  // The first hook of an optimizer cycle: records the step that ended, if any, and
  // resets what is gathered per cycle.
  void begin_cycle();
  agent::WriterThread& writer() { return recorder_->writer(); }

  AgentOptions options_;
  GradScaler* scaler_;
  std::string db_path_;
  agent::RankInfo rank_;
  kernels::CpuStatsEngine engine_;
  std::unique_ptr<agent::StepRecorder> recorder_;

  std::unordered_map<const void*, std::int64_t> layer_ids_;  // TensorImpl* -> layer id
  std::vector<at::Tensor> params_;                           // by layer id
  std::vector<std::pair<at::Tensor, unsigned>> hooks_;
  std::shared_ptr<ArrivalOrder> arrival_;
  std::unordered_map<std::string, std::string> module_types_;  // path -> type, from the model
  std::unordered_map<std::string, std::int64_t> module_ids_;
  std::unordered_set<std::string> events_posted_;

  // Per cycle: the sum of the losses given to scale() (micro-batches, several losses), how
  // many, and whether gradients were checked (an update() without a check is an extra
  // one that only changes the scale).
  bool cycle_open_ = false;
  double loss_sum_ = 0.0;
  std::int64_t losses_ = 0;
  bool checked_ = false;
  bool skipped_ = false;
  std::int64_t agent_ns_ = 0;
  Clock::time_point step_start_ = Clock::now();
  bool closed_ = false;

  // Per-call scratch, kept to avoid allocating on the training thread.
  std::vector<kernels::TensorRef> refs_;
  std::vector<kernels::MutableTensorRef> mutable_refs_;
  std::vector<kernels::TensorStats> stats_;
  std::vector<std::uint64_t> histograms_;
  std::vector<at::Tensor> copies_;
  std::vector<std::int64_t> ids_;
};

Agent::Impl::Impl(torch::nn::Module& model, GradScaler& scaler, AgentOptions options)
    : options_(std::move(options)),
      scaler_(&scaler),
      rank_(agent::rank_from_environment()),
      engine_([&] {
        kernels::CpuEngineOptions o;
        if (options_.threads < 0) throw std::invalid_argument("AgentOptions.threads must be >= 0 (0: torch's threads)");
        o.threads = options_.threads;
        if (options_.threads == 0) {
          // torch's intra-op (OpenMP) team: see CpuEngineOptions::parallel_for. This file is
          // compiled with OpenMP, or at::parallel_for would run serially.
          o.parallel_for = [](std::int64_t count, const std::function<void(std::int64_t)>& task) {
            at::parallel_for(0, count, 1, [&](std::int64_t begin, std::int64_t end) {
              for (std::int64_t i = begin; i < end; ++i) task(i);
            });
          };
        }
        return o;
      }()) {
  (void)agent::SamplingPolicy(options_.every, options_.context_steps);  // validates before anything is created
  if (!scaler.is_enabled())
    throw std::invalid_argument(
        "ampdiag::Agent: the GradScaler is disabled, so there is no loss scale to watch; enable it "
        "(fp16) or train without a scaler (bf16)");
  if (scaler.observer())
    throw std::invalid_argument("ampdiag::Agent: this GradScaler already has an agent attached; close() it first");
  if (options_.queue_capacity < 16)
    throw std::invalid_argument("AgentOptions.queue_capacity must be at least 16 records");
  if (model.parameters(/*recurse=*/true).empty())
    throw std::invalid_argument("ampdiag::Agent: the model has no parameters: nothing to watch");

  db_path_ = agent::rank_db_path(options_.db_path, rank_);
  // Opened here, on the caller's thread: a bad path fails now, before training starts.
  auto writer = std::make_unique<rundb::RunDbWriter>(db_path_, options_.overwrite);
  recorder_ = std::make_unique<agent::StepRecorder>(std::move(writer), options_.queue_capacity, options_.every,
                                                    options_.context_steps);

  register_layers(model);
  write_meta(scaler);
  scaler.set_observer(this);
}

void Agent::Impl::register_layers(torch::nn::Module& model) {
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true))
    module_types_[item.key()] = module_type_name(*item.value());
  std::int64_t frozen = 0;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    const std::string& name = item.key();
    const auto found = layer_ids_.find(p.unsafeGetTensorImpl());
    if (found != layer_ids_.end()) {
      post_event_once("shared:" + name, "shared-parameter",
                      name + " is the same tensor as " + std::string(params_[std::size_t(found->second)].name()) +
                          "; its statistics are recorded once, under layer " + std::to_string(found->second));
      continue;
    }
    const std::int64_t id = std::int64_t(params_.size());
    layer_ids_[p.unsafeGetTensorImpl()] = id;
    params_.push_back(p);
    rundb::LayerRow row;
    row.id = id;
    row.name = name;
    const auto dot = name.rfind('.');
    row.module_path = dot == std::string::npos ? "" : name.substr(0, dot);
    const auto type = module_types_.find(row.module_path);
    row.module_type = type == module_types_.end() ? "" : type->second;
    row.dtype = std::string(c10::toString(p.scalar_type()));
    row.shape = shape_text(p);
    row.numel = p.numel();
    row.trainable = p.requires_grad();
    frozen += row.trainable ? 0 : 1;
    writer().post_layer(std::move(row));
  }
  arrival_ = std::make_shared<ArrivalOrder>(params_.size());
  for (std::size_t id = 0; id < params_.size(); ++id) {
    at::Tensor& p = params_[id];
    if (!p.requires_grad()) continue;
    std::shared_ptr<ArrivalOrder> arrival = arrival_;
    const unsigned handle = p.register_hook([arrival, id](const at::Tensor&) { arrival->arrived(id); });
    hooks_.emplace_back(p, handle);
  }
  if (frozen > 0)
    writer().post_event({-1, "frozen-parameters",
                         std::to_string(frozen) + " parameters do not require grad; they are listed but have no statistics", 0.0});
}

void Agent::Impl::write_meta(const GradScaler& scaler) {
  auto meta = [&](const char* k, const std::string& v) { writer().post_meta(k, v); };
  meta("ampdiag_version", "0.1.0");
  meta("torch_version", TORCH_VERSION);
  meta("device", params_.empty() ? "cpu" : params_.front().device().str());
  meta("amp_dtype", options_.amp_dtype);
  meta("scaler_init_scale", std::to_string(scaler.get_scale()));
  meta("scaler_growth_factor", std::to_string(scaler.get_growth_factor()));
  meta("scaler_backoff_factor", std::to_string(scaler.get_backoff_factor()));
  meta("scaler_growth_interval", std::to_string(scaler.get_growth_interval()));
  meta("scaler_enabled", scaler.is_enabled() ? "1" : "0");
  meta("rank", std::to_string(rank_.rank));
  meta("world_size", std::to_string(rank_.world_size));
  meta("run_id", options_.run_id.empty() ? agent::default_run_id(rank_) : options_.run_id);
  meta("command_line", command_line());
  meta("pid", std::to_string(::getpid()));
  meta("every", std::to_string(options_.every));
  meta("context_steps", std::to_string(options_.context_steps));
  meta("fused_unscale", options_.fused_unscale ? "1" : "0");
  meta("histogram", options_.histogram ? "1" : "0");
  meta("stats_isa", kernels::cpu_isa_name(engine_.isa()));
  meta("source", "ampdiag C++ agent");
}

void Agent::Impl::post_event_once(const std::string& key, const std::string& kind, const std::string& detail) {
  if (!events_posted_.insert(key).second) return;
  writer().post_event({recorder_->step(), kind, detail, 0.0});
}

std::int64_t Agent::Impl::layer_of(const at::Tensor& param) {
  const auto found = layer_ids_.find(param.unsafeGetTensorImpl());
  if (found != layer_ids_.end()) return found->second;
  // The optimizer holds a parameter the model does not: record it under a made-up name.
  const std::int64_t id = std::int64_t(params_.size());
  layer_ids_[param.unsafeGetTensorImpl()] = id;
  params_.push_back(param);
  // No hook covers it (it is not a model parameter): its bwd_order stays -1.
  rundb::LayerRow row;
  row.id = id;
  row.name = "optimizer.param" + std::to_string(id);
  row.dtype = std::string(c10::toString(param.scalar_type()));
  row.shape = shape_text(param);
  row.numel = param.numel();
  row.trainable = true;
  writer().post_layer(row);
  post_event_once("foreign:" + std::to_string(id), "foreign-parameter",
                  row.name + " is optimized but is not a parameter of the attached model");
  return id;
}

std::int64_t Agent::Impl::module_id(const std::string& path) {
  const auto found = module_ids_.find(path);
  if (found != module_ids_.end()) return found->second;
  const std::int64_t id = std::int64_t(module_ids_.size());
  module_ids_[path] = id;
  const auto type = module_types_.find(path);
  writer().post_module({id, path, type == module_types_.end() ? "" : type->second, "", ""});
  return id;
}

at::Tensor Agent::Impl::probe(const std::string& path, const at::Tensor& x) {
  if (closed_ || !x.defined()) return x;
  if (!at::isFloatingType(x.scalar_type())) {
    post_event_once("probe-type:" + path, "warning",
                    "probe " + path + " saw a " + std::string(c10::toString(x.scalar_type())) +
                        " tensor; only floating-point outputs have statistics");
    return x;
  }
  const auto t0 = Clock::now();
  begin_cycle();
  at::Tensor copy;
  const kernels::TensorRef ref = agent::stats_view(x, copy);
  kernels::TensorStats s;
  engine_.compute(&ref, 1, &s);
  // The forward of micro-batch k runs before its k-th scale() call. (The Python agent
  // counts forwards that follow a backward; autograd hooks here may run on other threads.)
  recorder_->stage_act(module_id(path), recorder_->next_forward_order(), s, std::int32_t(losses_));
  agent_ns_ += ns_since(t0);
  return x;
}

void Agent::Impl::begin_cycle() {
  if (cycle_open_) return;
  cycle_open_ = true;
  recorder_->begin_step();
  arrival_->reset();
  loss_sum_ = 0.0;
  losses_ = 0;
  checked_ = false;
}

void Agent::Impl::on_scale(const at::Tensor& outputs) {
  const auto t0 = Clock::now();
  begin_cycle();
  // The loss before scaling; reading it is free on CPU and one sync on CUDA, where the
  // scaler's step() synchronises anyway. A non-scalar output (backward with an explicit
  // gradient) is no loss: counting it as NaN would report a NaN loss that never was.
  if (outputs.numel() == 1 && at::isFloatingType(outputs.scalar_type())) {
    loss_sum_ += outputs.detach().to(at::kDouble).item<double>();
    ++losses_;
  }
  agent_ns_ += ns_since(t0);
}

bool Agent::Impl::on_unscale(UnscaleBatch& batch) {
  const auto t0 = Clock::now();
  begin_cycle();
  checked_ = true;
  const std::size_t n = batch.grads.size();
  refs_.clear();
  ids_.clear();
  copies_.assign(n, at::Tensor());
  bool fusable = options_.fused_unscale && batch.found_inf.device().is_cpu() && batch.inv_scale.device().is_cpu();
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& g = batch.grads[i];
    const std::int64_t id = layer_of(batch.params[i]);
    ids_.push_back(id);
    if (batch.params[i].grad().is_sparse())
      post_event_once("sparse:" + std::to_string(id), "sparse-gradient",
                      "layer " + std::to_string(id) + " has sparse gradients: statistics cover their stored values");
    if (!agent::directly_readable(g)) {
      fusable = false;
      post_event_once("copied:" + std::to_string(id), "slow-path",
                      "layer " + std::to_string(id) + " has a " + std::string(c10::toString(g.scalar_type())) + " " +
                          g.device().str() + (g.is_contiguous() ? "" : " non-contiguous") +
                          " gradient: its statistics are taken on a CPU copy and torch unscales it");
    }
    refs_.push_back(agent::stats_view(g, copies_[i]));
  }
  stats_.resize(n);
  std::uint64_t* hist = nullptr;
  if (options_.histogram) {
    histograms_.resize(n * kernels::kHistBins);
    hist = histograms_.data();
  }
  bool handled = false;
  if (fusable) {
    // Same bits as torch's op; the statistics are those of the values before unscale.
    mutable_refs_.clear();
    for (std::size_t i = 0; i < n; ++i) mutable_refs_.push_back({batch.grads[i].data_ptr(), refs_[i].numel, refs_[i].dtype});
    const float inv = batch.inv_scale.item<float>();
    if (engine_.unscale_and_compute(mutable_refs_.data(), n, inv, stats_.data(), hist)) batch.found_inf.fill_(1.0);
    handled = true;
  } else {
    engine_.compute(refs_.data(), n, stats_.data(), hist);
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t id = std::size_t(ids_[i]);
    const std::int32_t order = id < arrival_->order.size() ? arrival_->order[id].load(std::memory_order_relaxed) : -1;
    recorder_->stage_grad(ids_[i], order, stats_[i], hist ? hist + i * kernels::kHistBins : nullptr);
  }
  copies_.clear();
  agent_ns_ += ns_since(t0);
  return handled;
}

void Agent::Impl::on_update(double scale_before, double scale_after, bool found_inf) {
  const auto t0 = Clock::now();
  if (!checked_) {
    // update(new_scale) after the cycle's update(), e.g. to hold a minimum scale: the
    // same optimizer cycle, ending at this scale.
    recorder_->amend_scale_after(scale_after);
    agent_ns_ += ns_since(t0);
    return;
  }
  agent::StepOutcome o;
  o.loss = losses_ > 0 ? loss_sum_ : std::numeric_limits<double>::quiet_NaN();
  o.losses = losses_;
  o.scale_before = scale_before;
  o.scale_after = scale_after;
  o.found_inf = found_inf;
  o.skipped = skipped_;
  o.step_ns = ns_since(step_start_);
  o.agent_ns = agent_ns_ + ns_since(t0);
  recorder_->end_step(o);
  skipped_ = false;
  cycle_open_ = false;
  checked_ = false;
  agent_ns_ = 0;
  step_start_ = Clock::now();
}

void Agent::Impl::close() {
  if (closed_) return;
  closed_ = true;
  if (scaler_ && scaler_->observer() == this) scaler_->set_observer(nullptr);
  for (auto& [param, handle] : hooks_) {
    try {
      param.remove_hook(handle);
    } catch (...) {
      // A parameter whose autograd meta is gone has no hook left to remove.
    }
  }
  hooks_.clear();
  if (recorder_) recorder_->close();
}

AgentStatus Agent::Impl::status() const {
  AgentStatus s;
  s.db_path = db_path_;
  if (recorder_) {
    const auto c = recorder_->counters();
    s.steps = c.steps;
    s.rows_written = c.rows_written;
    s.dropped = c.dropped;
    s.lost = c.lost;
    s.write_errors = c.write_errors;
    s.first_error = c.first_error;
  }
  return s;
}

Agent::Agent(torch::nn::Module& model, GradScaler& scaler, AgentOptions options)
    : impl_(std::make_unique<Impl>(model, scaler, std::move(options))) {}

Agent::~Agent() = default;

at::Tensor Agent::probe(const std::string& module_path, const at::Tensor& x) { return impl_->probe(module_path, x); }

void Agent::close() { impl_->close(); }

AgentStatus Agent::status() const { return impl_->status(); }

}  // namespace ampdiag
