// Builds run.db fixtures step by step for the analyzer tests: the test says what each
// step looks like, the builder writes it through the real RunDbWriter.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "ampdiag/rundb/writer.h"

namespace ampdiag::test {

class RunFixture {
 public:
  // `dtype`: the parameters' (torch's name: "float16" for a model stored in half precision).
  // `types`: module types by layer name where not "Linear". `shapes`: shapes by layer name
  // where not [64, 64] (the values counted from them).
  RunFixture(const std::string& path, std::vector<std::string> layers, std::int64_t rank = 0, std::int64_t world = 1,
             const std::string& dtype = "float32", const std::map<std::string, std::string>& types = {},
             const std::map<std::string, std::vector<std::int64_t>>& shapes = {})
      : writer_(path, true), layers_(std::move(layers)) {
    writer_.set_meta("amp_dtype", "float16");
    writer_.set_meta("device", "cpu");
    writer_.set_meta("rank", std::to_string(rank));
    writer_.set_meta("world_size", std::to_string(world));
    writer_.set_meta("scaler_growth_interval", "2000");
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const auto dot = layers_[i].rfind('.');
      // "optimizer.paramN" is what the agents call a parameter outside the attached model:
      // no module, no type.
      const bool outside = layers_[i].rfind("optimizer.param", 0) == 0;
      const auto shape = shapes.find(layers_[i]);
      const std::vector<std::int64_t> dims = shape == shapes.end() ? std::vector<std::int64_t>{64, 64} : shape->second;
      std::string text;
      std::int64_t numel = 1;
      for (const std::int64_t d : dims) {
        text += (text.empty() ? "[" : ", ") + std::to_string(d);
        numel *= d;
      }
      writer_.add_layer({std::int64_t(i), layers_[i], dot == std::string::npos || outside ? "" : layers_[i].substr(0, dot),
                         outside ? "" : types.count(layers_[i]) ? types.at(layers_[i]) : "Linear", dtype, text + "]",
                         numel, true, ""});
    }
  }

  // One step: every listed layer gets a gradient row (scaled abs-max `absmax`); the
  // layers in `nonfinite` (in backward order) hold Inf; skipped follows from them.
  RunFixture& step(double scale_before, double scale_after, double absmax = 1000.0,
                   const std::vector<std::string>& nonfinite = {}, double loss = 0.5,
                   const std::vector<std::string>& only_layers = {}) {
    rundb::StepRow s;
    s.step = step_;
    s.loss = next_no_loss_ ? std::nan("") : loss;
    s.losses = next_no_loss_ ? 0 : micro_batches_;
    s.scale_before = scale_before;
    s.scale_after = scale_after;
    s.found_inf = !nonfinite.empty() || (!std::isfinite(loss) && !next_taken_) || next_found_elsewhere_;
    s.skipped = s.found_inf && !next_taken_;
    next_taken_ = next_no_loss_ = next_found_elsewhere_ = false;
    s.sampled = true;
    s.wall_time = 1.7e9 + double(step_);
    std::int64_t order = 0;
    for (const auto& name : next_finite_first_) grad(name, order++, absmax, false);
    for (const auto& name : nonfinite) grad(name, order++, absmax, true);
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      if (!only_layers.empty() && std::find(only_layers.begin(), only_layers.end(), layers_[i]) == only_layers.end()) continue;
      if (std::find(nonfinite.begin(), nonfinite.end(), layers_[i]) != nonfinite.end()) continue;
      if (std::find(next_finite_first_.begin(), next_finite_first_.end(), layers_[i]) != next_finite_first_.end()) continue;
      grad(layers_[i], order++, absmax, false);
    }
    next_finite_first_.clear();
    next_unordered_ = false;
    next_l2_ = 0.0;
    next_l2_of_.clear();
    writer_.add_step(s);
    ++step_;
    return *this;
  }

  // Forward probe outputs for the current step (call before step()), 4096 values of L2 norm
  // `l2`; with histograms(), 100 of its values sit in the bin of `absmax`, the rest in that of
  // 0.1 (its amin_nz).
  // `zeros`: every value 0 (a dead ReLU's output), absmax and l2 0.
  RunFixture& activation(const std::string& module, bool nonfinite, double absmax = 10.0, double l2 = 100.0,
                         bool zeros = false) {
    std::int64_t id = -1;
    for (std::size_t i = 0; i < modules_.size(); ++i)
      if (modules_[i] == module) id = std::int64_t(i);
    if (id < 0) {
      id = std::int64_t(modules_.size());
      modules_.push_back(module);
      const auto source = sources_.find(module);
      const auto type = module_types_.find(module);
      writer_.add_module({id, module, type == module_types_.end() ? "Module" : type->second,
                          source == sources_.end() ? "" : source->second, ""});
    }
    rundb::ActStatRow a;
    a.step = step_;
    a.module_id = id;
    a.fwd_order = fwd_order_[step_]++;
    a.stats = {4096, nonfinite ? 3 : 0, 0, zeros ? 4096 : 0, 0, absmax, 0.1, l2};
    if (zeros) a.stats.absmax = a.stats.amin_nz = a.stats.l2 = 0.0;
    if (histograms_) {
      a.histogram.assign(rundb::kHistBins, 0);
      a.histogram[bin(absmax)] += 100;
      a.histogram[bin(a.stats.amin_nz)] += 4096 - 100 - (nonfinite ? 3 : 0);
    }
    writer_.add_act_stat(a);
    return *this;
  }

  // Where `module` is defined ("/torch/nn/modules/activation.py:100"), as its row will say: call
  // before its first activation().
  RunFixture& module_source(const std::string& module, const std::string& source) {
    sources_[module] = source;
    return *this;
  }

  // The type of `module` ("Linear"), as its row will say: call before its first activation().
  RunFixture& module_type(const std::string& module, const std::string& type) {
    module_types_[module] = type;
    return *this;
  }

  // The layer's gradients are `factor` times the step's absmax from now on.
  RunFixture& absmax_times(const std::string& layer, double factor) {
    absmax_factor_[layer] = factor;
    return *this;
  }

  RunFixture& zeros_fraction(const std::string& layer, double fraction, double subnormal_fraction = 0.0) {
    zero_fraction_[layer] = fraction;
    subnormal_fraction_[layer] = subnormal_fraction;
    return *this;
  }

  // The next step() is taken whatever it held (no scaler skipped it); a NaN/Inf loss alone
  // then leaves its gradients finite.
  RunFixture& taken() {
    next_taken_ = true;
    return *this;
  }

  // The next step() is skipped with every gradient of this rank finite: another rank's
  // held NaN/Inf (a scaler that reduces found_inf across the ranks, FSDP's).
  RunFixture& skipped_for_another_rank() {
    next_found_elsewhere_ = true;
    return *this;
  }

  // The next step's gradients of `layers` arrive first in backward, finite (before its
  // non-finite ones).
  RunFixture& finite_first(std::vector<std::string> layers) {
    next_finite_first_ = std::move(layers);
    return *this;
  }

  // Every step from now on sums `n` losses (gradient accumulation's micro-batches).
  RunFixture& micro_batches(std::int64_t n) {
    micro_batches_ = n;
    return *this;
  }

  // The next step() records no loss (scale() was given a non-scalar: backward with an
  // explicit gradient), which is unknown, not NaN.
  RunFixture& no_loss() {
    next_no_loss_ = true;
    return *this;
  }

  // The next step's gradients each have the L2 norm `each_l2` (a clip left every step's total
  // at the same value), or those of `only` where given; calls add up, the last one per layer.
  RunFixture& clipped(double each_l2, const std::vector<std::string>& only = {}) {
    if (only.empty()) next_l2_ = each_l2;
    for (const auto& name : only) next_l2_of_[name] = each_l2;
    return *this;
  }

  // An agent event on the step being built.
  RunFixture& event(const std::string& kind, const std::string& detail) {
    writer_.add_event({step_, kind, detail, 0.0});
    return *this;
  }

  RunFixture& meta(const std::string& key, const std::string& value) {
    writer_.set_meta(key, value);
    return *this;
  }

  // One layer's measured optimizer update on the step being built (half-precision
  // parameters): of `nonzero` elements with a gradient, `stalled` kept their value.
  RunFixture& weight_update(const std::string& layer, std::int64_t nonzero, std::int64_t stalled) {
    for (std::size_t i = 0; i < layers_.size(); ++i)
      if (layers_[i] == layer) writer_.add_weight_update({step_, std::int64_t(i), nonzero, stalled});
    return *this;
  }

  // A FP32 replay the agent recorded for a module ("finite", "nonfinite", "unconfirmed").
  RunFixture& replay(const std::string& module, const std::string& outcome, const std::string& reason = "") {
    writer_.add_replay({step_, module, outcome, outcome == "finite" ? 100.0 : std::nan(""), reason});
    return *this;
  }

  // A finite FP32 replay whose output reached `fp32_absmax`.
  RunFixture& finite_replay(const std::string& module, double fp32_absmax) {
    writer_.add_replay({step_, module, "finite", fp32_absmax, ""});
    return *this;
  }

  // A precision check at the current step: `module`'s output (`numel` values, `zeroed` of
  // them 0 where FP32's were not) was `rel_error` away from the same call in FP32.
  RunFixture& precision_check(const std::string& module, double rel_error, std::int64_t zeroed = 0,
                              double fp32_absmax = 4.0, std::int64_t numel = 1024) {
    writer_.add_precision_check({step_, module, "float16", numel, rel_error, zeroed, fp32_absmax});
    return *this;
  }

  // Every layer's weights at the start of the current step, their L2 norm `l2` (abs-max a tenth).
  RunFixture& weight_norms(double l2) {
    for (std::size_t i = 0; i < layers_.size(); ++i) writer_.add_weight_norm({step_, std::int64_t(i), l2, l2 / 10});
    return *this;
  }

  // One layer's weights at this step (`l2`, 4096 values: gain l2 / 8 for a [64, 64] matrix).
  RunFixture& weight_norm(const std::string& layer, double l2) {
    for (std::size_t i = 0; i < layers_.size(); ++i)
      if (layers_[i] == layer) writer_.add_weight_norm({step_, std::int64_t(i), l2, l2 / 10});
    return *this;
  }

  // Exponent histograms on every gradient and activation row from now on (meta histogram=1): its values
  // sit in the bins of its abs-max and of its smallest non-zero value.
  RunFixture& histograms() {
    histograms_ = true;
    writer_.set_meta("histogram", "1");
    return *this;
  }

  // The next step's gradients arrive where no hook sees them (bwd_order -1), as FSDP2's
  // sharded ones do.
  RunFixture& unordered() {
    next_unordered_ = true;
    return *this;
  }

  void finish() { writer_.finish(); }
  void commit() { writer_.commit(); }

 private:
  void grad(const std::string& name, std::int64_t order, double absmax, bool nonfinite) {
    std::int64_t id = 0;
    for (std::size_t i = 0; i < layers_.size(); ++i)
      if (layers_[i] == name) id = std::int64_t(i);
    if (const auto k = absmax_factor_.find(name); k != absmax_factor_.end()) absmax *= k->second;
    rundb::GradStatRow g;
    g.step = step_;
    g.layer_id = id;
    g.bwd_order = next_unordered_ ? -1 : order;
    const auto z = zero_fraction_.find(name);
    const std::int64_t zeros = z == zero_fraction_.end() ? 0 : std::int64_t(z->second * 4096);
    const auto sub = subnormal_fraction_.find(name);
    const std::int64_t subnormal = sub == subnormal_fraction_.end() ? 0 : std::int64_t(sub->second * 4096);
    // The norm moves with the batch (step and layer), as a real gradient's does, unless a
    // test fixed it (clipped()).
    const auto own = next_l2_of_.find(name);
    const double l2 = own != next_l2_of_.end() ? own->second
                      : next_l2_ > 0.0         ? next_l2_
                                               : 10.0 * (1.0 + 0.1 * double((step_ * 7 + id * 3) % 11));
    g.stats = {4096, nonfinite ? 5 : 0, nonfinite ? 2 : 0, zeros, subnormal, absmax, subnormal ? 1e-6 : 1e-3, l2};
    if (histograms_) {
      g.histogram.assign(rundb::kHistBins, 0);
      g.histogram[bin(absmax)] += 100;
      g.histogram[bin(g.stats.amin_nz)] += std::uint32_t(4096 - 100 - zeros);
    }
    writer_.add_grad_stat(g);
  }

  static std::size_t bin(double v) { return std::size_t(1 + std::ilogb(v) - rundb::kHistMinExp); }

  rundb::RunDbWriter writer_;
  std::vector<std::string> layers_;
  std::vector<std::string> modules_;
  std::map<std::int64_t, std::int64_t> fwd_order_;
  std::map<std::string, double> zero_fraction_;
  std::map<std::string, double> absmax_factor_;
  std::map<std::string, std::string> sources_;  // module_source()
  std::map<std::string, std::string> module_types_;  // module_type()
  std::map<std::string, double> subnormal_fraction_;
  std::int64_t step_ = 0;
  bool histograms_ = false;
  std::int64_t micro_batches_ = 1;
  bool next_taken_ = false;
  bool next_unordered_ = false;
  std::vector<std::string> next_finite_first_;
  bool next_no_loss_ = false;
  bool next_found_elsewhere_ = false;
  double next_l2_ = 0.0;                      // 0: the varying default
  std::map<std::string, double> next_l2_of_;  // clipped(l2, only) by layer, before next_l2_
};

}  // namespace ampdiag::test
