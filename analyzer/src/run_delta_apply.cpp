// apply_run_delta: merges what read_run_delta read into a Run. The cost is the delta's
// size (and a sort where rows arrived out of step order), not the Run's.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <stdexcept>

#include "ampdiag/analyzer/run_delta.h"
#include "histogram_counts.h"
#include "loss_code.h"
#include "suggestions.h"

namespace ampdiag::analyzer {

namespace {

// A skipped step counts for the layer whose gradient went non-finite first in it.
void count_first(Run& run, const StepSummary& s, int sign) {
  if (s.row.skipped && s.nonfinite_ordered && !s.nonfinite_layers.empty()) run.layers[std::size_t(s.nonfinite_layers.front())].first_nonfinite += sign;
}

void set_order(Run& run, StepSummary& s, StepOrder order) {
  std::sort(order.nonfinite.begin(), order.nonfinite.end());
  count_first(run, s, -1);
  s.nonfinite_layers.clear();
  for (const auto& [bwd_order, layer] : order.nonfinite) s.nonfinite_layers.push_back(layer);
  // A parameter outside the attached model (a GAN's discriminator) has no hook by nature:
  // where only such went NaN/Inf, the finding is that they are outside, whichever came first.
  s.nonfinite_ordered = !order.nonfinite.empty() &&
                        (order.nonfinite.front().first != StepOrder::kUnordered ||
                         suggest::outside_model(run.layers[std::size_t(order.nonfinite.front().second)].info));
  s.last_finite_before = order.last_finite_before;
  if (s.nonfinite_ordered && !order.finite_before.empty())
    run.arrived_before[s.nonfinite_layers.front()].insert(order.finite_before.begin(), order.finite_before.end());
  count_first(run, s, +1);
}

// Gives each step in `pending` (by step) that the run now has its value, and forgets it;
// the others wait for their steps row.
template <typename Value, typename Give>
void settle(Run& run, std::map<std::int64_t, Value>& pending, Give give) {
  for (auto it = pending.begin(); it != pending.end();) {
    if (StepSummary* s = run.step_summary(it->first)) {
      give(*s, it->second);
      it = pending.erase(it);
    } else {
      ++it;
    }
  }
}

// New step rows, and rows read again (the agent rewrites a step's row when it records the
// steps before an overflow after all).
void merge_steps(Run& run, std::vector<rundb::StepRow>& rows) {
  for (auto& row : rows) {
    if (run.steps.empty() || row.step > run.steps.back().row.step) {
      run.steps.push_back({row, {}, -1, -1});
    } else if (StepSummary* s = run.step_summary(row.step)) {
      count_first(run, *s, -1);
      s->row = row;
      count_first(run, *s, +1);
    } else {
      const auto at = std::lower_bound(run.steps.begin(), run.steps.end(), row.step,
                                       [](const StepSummary& s, std::int64_t v) { return s.row.step < v; });
      run.steps.insert(at, {row, {}, -1, -1});
    }
  }
}

void merge_grads(Run& run, std::vector<GradPart>& parts) {
  std::vector<std::size_t> old_size(run.layers.size());
  for (std::size_t l = 0; l < run.layers.size(); ++l) old_size[l] = run.layers[l].samples.size();
  for (auto& p : parts) {
    run.grad_rows += p.rows;
    for (std::size_t l = 0; l < p.samples.size(); ++l) {
      LayerSummary& layer = run.layers[l];
      for (const GradSample& g : p.samples[l]) layer.nonfinite_steps += g.nonfinite;
      if (layer.samples.empty()) layer.samples = std::move(p.samples[l]);
      else layer.samples.insert(layer.samples.end(), p.samples[l].begin(), p.samples[l].end());
      const auto [amin, at] = p.least_nonzero[l];
      if (at >= 0 && (layer.least_nonzero_step < 0 || amin < layer.least_nonzero))
        layer.least_nonzero = amin, layer.least_nonzero_step = at;
    }
  }
  // Summaries are in the order the writer committed them: a step written late sorts in.
  const auto by_step = [](const GradSample& a, const GradSample& b) { return a.step < b.step; };
  for (std::size_t l = 0; l < run.layers.size(); ++l) {
    auto& samples = run.layers[l].samples;
    const auto mid = samples.begin() + std::ptrdiff_t(old_size[l]);
    if (!std::is_sorted(mid, samples.end(), by_step)) std::stable_sort(mid, samples.end(), by_step);
    if (mid != samples.begin() && mid != samples.end() && by_step(*mid, *(mid - 1)))
      std::inplace_merge(samples.begin(), mid, samples.end(), by_step);
  }
}

// The steps of the events of one kind, sorted, for the Run's binary searches.
std::vector<std::int64_t> event_steps(const std::vector<rundb::EventRow>& events, const std::string& kind) {
  std::vector<std::int64_t> steps;
  for (const auto& e : events)
    if (e.kind == kind) steps.push_back(e.step);
  std::sort(steps.begin(), steps.end());
  return steps;
}

// The step of the first event of that kind (one written before the first step counts from 0); -1: none.
std::int64_t first_event_step(const std::vector<rundb::EventRow>& events, const std::string& kind) {
  const std::vector<std::int64_t> steps = event_steps(events, kind);
  return steps.empty() ? -1 : std::max<std::int64_t>(steps.front(), 0);
}

// Run::first_nonfinite_update and what it rests on.
void find_nonfinite_update(Run& run) {
  run.first_nonfinite_update = -1;
  run.update_from_finite_gradients = false;
  run.parameters_found_nonfinite = -1;
  for (const auto& s : run.steps)
    if (!s.row.skipped && s.gradients_nonfinite()) {
      run.first_nonfinite_update = s.row.step;
      break;
    }
  const rundb::EventRow* found = run.first_event("parameters-nonfinite");
  if (!found || found->step < 0) return;
  run.parameters_found_nonfinite = found->step;
  if (run.first_nonfinite_update >= 0 && run.first_nonfinite_update < found->step) return;
  // No update applied NaN/Inf gradients before the parameters were found holding them: the
  // last update before, from finite gradients, wrote them; none: they were there from the start.
  run.first_nonfinite_update = -1;
  for (const auto& s : run.steps) {
    if (s.row.step >= found->step) break;
    if (!s.row.skipped) run.first_nonfinite_update = s.row.step;
  }
  run.update_from_finite_gradients = run.first_nonfinite_update >= 0;
}

// torch.nn.utils.parametrize keeps a parametrized weight's tensors in a ParametrizationList,
// as "M.parametrizations.weight.original" (original0, original1, ...), and recomputes the
// weight from them whenever M's forward reads it: M is the module that uses them, where
// their gradient overflows and what a pin must cover. The layer becomes M's, with M's type.
// A parametrization of the root model itself stays where it is.
void parametrized_to_their_module(Run& run, std::size_t first_new) {
  static const std::string kMarker = ".parametrizations.";
  for (std::size_t l = first_new; l < run.layers.size(); ++l) {
    rundb::LayerRow& layer = run.layers[l].info;
    const auto at = layer.name.find(kMarker);
    if (at == std::string::npos || at == 0) continue;
    const std::string owner = layer.name.substr(0, at);
    if (!suggest::within(layer.module_path, owner) || layer.module_path == owner) continue;
    layer.module_path = owner;
    for (const auto& m : run.modules)
      if (m.info.path == owner) layer.module_type = m.info.module_type;
  }
}

// Run::loss_backward_overflow_from: the output-gradient steps' lowest scale, where the rate
// they came at above it would have put kChance or more among the steps below it, which had
// none, and the loss code computes in half or casts the model's half output up (an STFT loss
// on a float16 waveform: Inf at 65536 to 16384 where its gradient is cast back down, NaN
// where the three resolutions' Infs of both signs add up, none in 36 steps at 8192).
void find_loss_backward_overflow(Run& run) {
  constexpr double kChance = 4.0;  // none where 4 were expected: a 2 % chance
  run.loss_backward_overflow_from = std::numeric_limits<double>::infinity();
  if (run.output_gradient_steps.empty() || !run.has_scaler()) return;
  double lowest = std::numeric_limits<double>::infinity();
  std::int64_t found = 0;  // its steps with a steps row, all at `lowest` or above
  for (const auto& s : run.steps)
    if (run.output_gradient_nonfinite(s.row.step)) {
      lowest = std::min(lowest, s.row.scale_before);
      ++found;
    }
  if (!(lowest > 1.0) || std::isinf(lowest)) return;
  std::int64_t above = 0, below = 0;
  for (const auto& s : run.steps) (s.row.scale_before < lowest ? below : above) += 1;
  const loss_code::Code code = loss_code::at_steps(run, run.output_gradient_steps);
  if (!code.empty() && (!code.all_full_precision() || code.casts_half_up()) &&
      double(found) / double(above) * double(below) >= kChance)
    run.loss_backward_overflow_from = lowest;
}

// Run::output_overflow_in_loss_code.
void find_output_overflow_in_loss_code(Run& run) {
  run.output_overflow_in_loss_code = false;
  if (run.output_overflow_steps.empty() || !run.has_scaler()) return;
  const loss_code::Code code = loss_code::at_steps(run, run.output_overflow_steps);
  if (code.empty() || code.all_full_precision()) return;
  for (const auto& s : run.steps)
    if (s.row.scale_before <= Run::kLossOverflowScale &&
        std::binary_search(run.output_overflow_steps.begin(), run.output_overflow_steps.end(), s.row.step)) {
      run.output_overflow_in_loss_code = true;
      return;
    }
}

}  // namespace

void apply_run_delta(Run& run, RunDelta&& d) {
  if (d.reload) throw std::invalid_argument("apply_run_delta: the delta asks for the file to be read again whole (load_run)");
  run.meta = std::move(d.meta);
  run.finished = d.finished;
  run.rank = std::atoll(run.meta_or("rank", "0").c_str());
  run.world_size = std::atoll(run.meta_or("world_size", "1").c_str());
  run.run_id = run.meta_or("run_id", "");
  // The largest finite value of the run's precision (a run with AMP off is float32).
  const std::string amp_dtype = run.meta_or("amp_dtype", "float16");
  run.fp_max = amp_dtype == "bfloat16" ? 3.3895313892515355e38 : amp_dtype == "float32" ? 3.4028234663852886e38 : 65504.0;
  const std::size_t first_new_layer = run.layers.size();
  for (auto& row : d.layers) run.layers.push_back({std::move(row), {}, 0, 0, 0.0, -1, {}});
  for (auto& row : d.modules) {
    run.modules.emplace_back();
    run.modules.back().info = std::move(row);
  }
  parametrized_to_their_module(run, first_new_layer);
  run.events = std::move(d.events);
  run.input_nan_steps = event_steps(run.events, "input-nan");
  run.output_gradient_steps = event_steps(run.events, "output-gradient-nonfinite");
  run.output_overflow_steps = event_steps(run.events, "output-gradient-overflow");
  run.forward_dropped_steps = event_steps(run.events, "forward-dropped");
  run.evaluation_steps = event_steps(run.events, "evaluation-nonfinite");
  run.scaled_gradients_in_loss_from = first_event_step(run.events, "scaled-gradients-in-loss");
  run.gradients_differentiated_from = first_event_step(run.events, "gradients-differentiated");
  run.replays = std::move(d.replays);
  run.precision_checks = std::move(d.precision_checks);
  for (const auto& w : d.weight_norms)
    if (std::size_t(w.layer_id) >= run.layers.size())
      throw rundb::RunDbError(run.path + ": weight_norms names layer " + std::to_string(w.layer_id) +
                              ", which the layers table does not hold (the file is damaged)");
  run.weight_norms = std::move(d.weight_norms);
  merge_steps(run, d.steps);
  merge_grads(run, d.grads);
  for (std::size_t l = 0; l < run.layers.size() && l < d.histograms.size(); ++l) add_counts(run.layers[l].histogram, d.histograms[l]);

  for (const auto& [id, m] : d.module_stats) {
    ModuleSummary& module = run.modules[std::size_t(id)];
    module.nonfinite_steps += m.nonfinite_steps;
    module.first_nonfinite += m.first_nonfinite;
    if (module.first_step < 0) module.first_step = m.first_step;
    if (!module.before_known && m.before_known) {
      module.before_known = true;
      module.before_first = m.before_first;
    }
    module.max_absmax = std::max(module.max_absmax, m.max_absmax);
    module.output_rms_sum += m.rms_sum;
    module.output_rms_rows += m.rms_rows;
    if (m.zero_step >= module.zero_step) {
      module.zero_step = m.zero_step;
      module.zero_numel = m.zero_numel;
    }
    module.last_steps += m.last_steps;
    // The forward its calls were first counted in, or more of that same forward's calls.
    if (m.growth.calls > 0 && (module.growth.calls == 0 || (module.growth.step == m.growth.step &&
                                                            module.growth.micro_batch == m.growth.micro_batch)))
      module.growth = m.growth;
    if (m.position >= 0) {
      module.before_last = m.before_last;
      module.position = m.position;
    }
    if (m.jump_before > 0.0f &&
        (module.jump_before == 0.0f || m.jump_absmax / m.jump_before > module.jump_absmax / module.jump_before)) {
      module.jump_absmax = m.jump_absmax;
      module.jump_before = m.jump_before;
    }
  }
  run.act_rows += d.act_rows;

  // What the rows said about each step goes to its step, or waits for its row.
  auto& pending_order = run.cursor.pending_order;
  auto& pending_module = run.cursor.pending_module;
  for (auto& p : d.grads)
    for (auto& [step, order] : p.order) pending_order[step] = std::move(order);
  for (const auto& [step, module] : d.first_nonfinite_module) pending_module[step] = module;
  settle(run, pending_order, [&](StepSummary& s, StepOrder& order) { set_order(run, s, std::move(order)); });
  settle(run, pending_module, [](StepSummary& s, std::int64_t module) { s.first_nonfinite_module = module; });
  d.next.pending_order = std::move(pending_order);
  d.next.pending_module = std::move(pending_module);
  run.cursor = std::move(d.next);
  find_nonfinite_update(run);
  find_loss_backward_overflow(run);
  find_output_overflow_in_loss_code(run);
}

}  // namespace ampdiag::analyzer
