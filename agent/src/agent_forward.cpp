// Agent's forward side: probes and modules run through forward() (their statistics, the FP32
// replay of the step's first NaN/Inf module and the code around it, the exception a module
// left), the batch given to input(), and the autocast dtype the first training probe shows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ampdiag/pin_fp32.h"
#include "agent_impl.h"
#include "agent_setup.h"
#include "autocast_state.h"

namespace ampdiag {

bool Agent::Impl::record(const std::string& path, const at::Tensor& x, const at::Tensor* module_input) {
  if (closed_ || !x.defined()) return false;
  if (!at::isFloatingType(x.scalar_type())) {
    session_.event_once("probe-type:" + path, "warning",
                        "probe " + path + " saw a " + agent::dtype_name(x.scalar_type()) +
                            " tensor; only floating-point outputs have statistics");
    return false;
  }
  const auto timed = agent_time();
  begin_cycle();
  last_output_ = x;
  last_output_path_ = path;
  if (x.grad_fn() && step_outputs_.size() < kStepOutputs) step_outputs_.push_back(agent::mark_of(x));
  if (options_.replay) entries_.output(path, x);
  if (learn_amp_dtype_) learn_amp_dtype(x.device().type(), x.scalar_type());
  at::Tensor copy;
  agent::DeviceTensor view;
  bool first_nonfinite = false;
  if (agent::stats_view(x, copy, view)) {
    const std::int64_t module = session_.module_id(path, module_type(path), "", "");
    // The forward of micro-batch k runs before its k-th scale() call. (The Python agent
    // counts forwards that follow a backward; autograd hooks here may run on other threads.)
    // Known at once for host tensors only: a device tensor's result lands later.
    first_nonfinite = session_.activation(module, view, std::int32_t(losses_)) && !nonfinite_seen_;
    nonfinite_seen_ = nonfinite_seen_ || first_nonfinite;
    if (first_nonfinite) {
      // A NaN batch or NaN weights are no fp16 overflow: a replay would only say "intrinsic".
      if (batch_.nonfinite(module_input)) first_nonfinite = false;
      else look_at_parameters();
    }
  }
  return first_nonfinite && !parameters_nonfinite_;
}

at::Tensor Agent::Impl::input(const std::string& name, const at::Tensor& x) {
  if (closed_ || !x.defined() || !x.is_floating_point()) return x;
  begin_cycle();
  batch_.add(name, x);
  return x;
}

// The first training probe's autocast dtype, where the options left the run's to it. With
// autocast off, the probed output's own dtype: a float32 one is a run with AMP off, which
// was judged by the guess's range (float16 with a scaler, bfloat16 without one).
void Agent::Impl::learn_amp_dtype(c10::DeviceType device, at::ScalarType output) {
  if (!at::GradMode::is_enabled()) return;  // an evaluation: wait for a training forward
  const bool autocast = agent::autocast_enabled(device);
  if (awaiting_autocast_) {
    const at::ScalarType dtype = autocast ? agent::autocast_dtype(device) : at::kFloat;
    if (dtype != at::kBFloat16 && dtype != at::kHalf) return;
    learn_amp_dtype_ = awaiting_autocast_ = false;
    const std::string seen = agent::dtype_name(dtype);
    session_.set_meta("amp_dtype", seen);
    session_.event("amp-dtype", "autocast turned on in " + seen + " at step " + std::to_string(session_.step()) +
                                    ", after a start in float32: the run is judged in " + seen);
    return;
  }
  learn_amp_dtype_ = false;
  const at::ScalarType dtype = autocast ? agent::autocast_dtype(device) : output;
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return;
  const std::string seen = agent::dtype_name(dtype);
  const std::string guessed = scaler_ ? "float16" : "bfloat16";
  if (seen == guessed) return;
  const std::string assumed = "the " + guessed + (scaler_ ? " AgentOptions::amp_dtype left empty assumed"
                                                          : " assumed for an Agent without a GradScaler");
  session_.set_meta("amp_dtype", seen);
  if (!autocast) {
    session_.event("amp-dtype", "autocast was off at the first training probe, whose output was " + seen +
                                    ": the run is judged in " + seen + ", not " + assumed);
    // With a scaler, a float32 warm-up may come first: the probes watch for autocast after it.
    learn_amp_dtype_ = awaiting_autocast_ = dtype == at::kFloat && scaler_ != nullptr;
  }
  else
    session_.event("amp-dtype", "autocast ran in " + seen + ", not " + assumed + ": the run is judged in " + seen +
                                    (dtype == at::kBFloat16 ? " (bfloat16 needs no GradScaler)" : ""));
}

// As the Python agent words it. Host parameters only, for the reason input() gives.
void Agent::Impl::look_at_parameters() {
  if (parameters_nonfinite_) return;
  std::vector<std::string> bad;
  std::size_t total = 0;
  for (const auto& [name, p] : named_params_) {
    if (!p.device().is_cpu() || !p.is_floating_point()) continue;
    ++total;
    // A frozen parameter's -inf is a mask kept as a parameter, by design: NaN only there.
    const at::Tensor d = p.detach();
    if (p.requires_grad() ? !at::isfinite(d).all().item<bool>() : at::isnan(d).any().item<bool>()) bad.push_back(name);
  }
  if (bad.empty()) return;
  parameters_nonfinite_ = true;
  std::string listed;
  for (std::size_t i = 0; i < bad.size() && i < 5; ++i) listed += (i ? ", " : "") + bad[i];
  if (bad.size() > 5) listed += " (+" + std::to_string(bad.size() - 5) + " more)";
  session_.event("parameters-nonfinite",
                 std::to_string(bad.size()) + " of " + std::to_string(total) + " parameter tensors: " + listed);
}

at::Tensor Agent::Impl::forward_as(const std::string& path, const Forward& run, const Forward& replay,
                                   const at::Tensor& x) {
  if (closed_) return run(x);
  begin_cycle();
  at::Tensor y;
  if (replay_pins_.pinned(path)) {
    AutocastDisabled off;
    y = run_module(path, run, to_fp32(x));
    chained_call(path, x, y);
    record(path, y);
    return y;
  }
  if (inputs_seen_.insert(path).second && last_output_.defined() && agent::is_or_views(x, last_output_))
    session_.event_once("module-input-from:" + path, "module-input-from", path + ": " + last_output_path_);
  const std::size_t outputs_before = step_outputs_.size();  // the code after them is the caller's
  const bool check = checks_.wants(path, x);
  if (check) checks_.before(x);
  if (options_.replay) {
    y = run_module(path, run, entries_.input(path, x));
    entries_.returned(y);
  } else {
    y = run_module(path, run, x);
  }
  chained_call(path, x, y);
  const at::Tensor inner_last = last_output_;  // the last output probed inside it, if any
  const std::size_t outputs_inside = step_outputs_.size();
  if (record(path, y, &x)) {
    const std::string outcome = replay_pins_.nonfinite_output(path, replay, x, batch_.viewed_by(x) != nullptr);
    if (outcome == "nonfinite") {
      read_code("input-code", path, x, outputs_before, nullptr);
    } else if ((outcome == "finite" || outcome == "intrinsic") && torch_leaves_.count(path) == 0 &&
               !(inner_last.defined() && agent::is_or_views(y, inner_last))) {
      // Its own code made the output (not a Linear's one operation, nor its last submodule's
      // output as it is): what that code ran after its submodules and its input.
      read_code("module-code", path, y, outputs_inside, &x);
    }
  } else if (check) {
    const auto timed = agent_time();
    replay_pins_.lossy_output(path, checks_.after(path, y, replay));
  }
  return y;
}

// Event `kind`, "PATH: Op:dtype, ...", the operations that made `t` down to the step's first
// `outputs` probed outputs (and `input`), as the Python agent's _read_code(): "input-code", the
// caller's code that made the NaN/Inf input a module only received; "module-code", a module's
// own code, where it made the NaN/Inf. Once a module and kind, kCodeLooks a run.
void Agent::Impl::read_code(const char* kind, const std::string& path, const at::Tensor& t, std::size_t outputs,
                            const at::Tensor* input) {
  if (code_looks_ >= kCodeLooks) return;
  std::vector<agent::NodeMark> stops(step_outputs_.begin(), step_outputs_.begin() + std::min(outputs, step_outputs_.size()));
  if (input != nullptr) stops.push_back(agent::mark_of(*input));
  const std::string code = agent::code_under(t, stops);
  if (code.empty()) return;
  ++code_looks_;
  session_.event_once(std::string(kind) + ":" + path, kind, path + ": " + code);
}

at::Tensor Agent::Impl::run_module(const std::string& path, const Forward& run, const at::Tensor& x) {
  try {
    at::Tensor y = run(x);
    raised_in_.clear();  // one the module's code caught, or the loop caught earlier, and trained on
    return y;
  } catch (...) {
    // The first forward_as() the exception leaves is the innermost: the module whose code
    // refused (oneDNN's float16 LSTM), which the report names beside the exception.
    if (raised_in_.empty()) raised_in_ = path;
    throw;
  }
}

void Agent::Impl::raised_in() {
  if (raised_in_.empty()) return;
  const std::string type = module_type(raised_in_);
  session_.event("training-raised-in", type.empty() ? raised_in_ : raised_in_ + " (" + type + ")");
}

void Agent::Impl::chained_call(const std::string& path, const at::Tensor& x, const at::Tensor& y) {
  if (chains_.call(path, x, y, {session_.step(), losses_}))
    session_.event_once("chained-calls:" + path, "chained-calls", path);
}

}  // namespace ampdiag
