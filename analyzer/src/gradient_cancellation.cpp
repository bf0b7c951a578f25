// Telling a gradient that cancels to rounding from one the loss scale flushes.
#include "gradient_cancellation.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "overflow_events.h"
#include "true_gradients.h"

namespace ampdiag::analyzer::rules {

namespace {

// A bias, or a vector of one value per feature (its name's last part says "bias", or its
// shape has one dimension): what can cancel to rounding. A weight's gradient far below its
// bias's is one taken on tiny inputs (a deep network's vanishing activations), which the
// scale does flush.
bool bias_like(const rundb::LayerRow& info) {
  return info.name.find("bias", info.name.rfind('.') + 1) != std::string::npos || dims_of(info.shape).size() == 1;
}

// How far `layer`'s gradient sits below the other gradients of its module at the same
// steps, per element (RMS): {ratio to the smallest of them, that layer}; {1, null} where
// it has none. A bias whose sum over a softmax's shifted dimension (an attention key's) or
// over what a normalisation after it removes is zero in exact arithmetic is left with
// rounding, hundreds to thousands of times below its weight's gradient: not what the scale
// flushes. `any_range`: against a sibling whatever share of it underflows, for a bias whose
// sum is zero by the structure after it (mean_removing_norm_after).
std::pair<double, const LayerSummary*> below_siblings(const Run& run, const LayerSummary& layer,
                                                     double underflow_fraction, bool any_range = false) {
  std::pair<double, const LayerSummary*> lowest{1.0, nullptr};
  if (layer.info.module_path.empty() || !bias_like(layer.info)) return lowest;
  for (const auto& other : run.layers) {
    if (&other == &layer || other.info.module_path != layer.info.module_path || other.info.numel < 16) continue;
    double mine = 0.0, theirs = 0.0, their_zeros = 0.0, their_sub = 0.0;
    std::int64_t n = 0;
    auto o = other.samples.begin();
    for (const auto& s : layer.samples) {
      while (o != other.samples.end() && o->step < s.step) ++o;
      if (o == other.samples.end()) break;
      if (o->step != s.step || s.nonfinite || o->nonfinite) continue;
      mine += double(s.l2) / std::sqrt(double(layer.info.numel));
      theirs += double(o->l2) / std::sqrt(double(other.info.numel));
      their_zeros += double(o->zero_q) / 65535.0;
      their_sub += double(o->sub_q) / 255.0;
      ++n;
    }
    if (n == 0) continue;
    // Only against a gradient the same scale keeps in range: mostly normal values, or exact
    // zeros many times its subnormals, a population no scale makes, beside more normal values
    // than subnormal ones (BERT's key weight under a softmax saturated to 0 and 1 by query and
    // key weights 3000 times too large: 98 % zeros, 0.9 % subnormal, 1.3 % normal).
    const double zeros = their_zeros / double(n), sub = their_sub / double(n);
    const bool in_range = zeros + sub <= underflow_fraction || (zeros >= 5.0 * sub && 1.0 - zeros - sub > sub);
    if (theirs > 0.0 && (in_range || any_range) && mine / theirs < lowest.first) lowest = {mine / theirs, &other};
  }
  return lowest;
}

// The per-element RMS of what a weight matrix's module takes in, estimated from what it makes:
// y = W x (+ b) sums fan-in products, |y| ~ sqrt(fan_in) |W| |x| for weights not aligned with
// their input (a bias in y only raises the estimate). 0 where the run has no finite output
// row for the module or no norm of the weight.
double input_rms(const Run& run, const LayerSummary& weight) {
  const std::vector<std::int64_t> dims = dims_of(weight.info.shape);
  if (dims.size() < 2 || dims.front() <= 0 || weight.info.numel <= 0) return 0.0;
  const ModuleSummary* module = run.module_named(weight.info.module_path);
  if (module == nullptr || module->output_rms_rows == 0) return 0.0;
  const double rms = mean_weight_rms(run, weight);
  if (!(rms > 0.0)) return 0.0;
  const double fan_in = double(weight.info.numel) / double(dims.front());
  return module->output_rms_sum / double(module->output_rms_rows) / (std::sqrt(fan_in) * rms);
}

// Rounding left by a sum that cancels (n terms of a gradient g, each rounded to fp16's
// 2^-11) is ~3e-4 of g per element, and the weight's gradient beside it ~|x| times g, x
// the module's input: a ratio of ~3e-4 / |x|. A bias that truly underflows sits at
// ~1 / |x| of its weight's. Below 1/512 separates the two for inputs of RMS 0.14 to 512:
// ELECTRA's first key bias, after its unnormalised embedding projection, is at 1/725
// (1/1024 called it an underflow); raw pixel values of up to 255 stay on the other side.
// Below a weight taking small inputs, a true gradient sits ~1 / |x| of the weight's, so
// the same bound holds for the ratio times |x|: the embeddings of DeBERTa's relative
// positions (RMS 0.02 without their norm) leave its position keys' bias at 1/47 of the
// weight's, rounding all the same (2^-11 / 0.02). Where the weight's module is torch's own
// Linear or convolution, its output is W x + b and the estimate of |x| holds at any size: a
// true gradient's ratio times |x| is about 1, and rounding's a few 2^-11, so below 1/64
// separates them. DETR's key biases sit at 1/114 to 1/293 of their weights' on inputs of
// RMS 1 (more rounding than 2^-11 / |x|: the softmax's gradient is rounded to fp16 before
// the product that sums it to zero); raw pixels of up to 255 give a true bias's ratio
// times |x| of about 1 still.
bool own_cancels(double ratio, const LayerSummary* sibling, double input, bool products_only) {
  if (sibling == nullptr) return false;
  if (ratio < 1.0 / 512.0) return true;
  if (!(input > 0.0)) return false;
  return (input < 1.0 && ratio * input < 1.0 / 512.0) || (products_only && ratio * input < 1.0 / 64.0);
}

// Whether the estimate of a sibling's input holds at any size (input_rms above).
bool products_only(const Run& run, const LayerSummary* sibling) {
  return sibling != nullptr && !products_only_type(run, sibling->info.module_path).empty();
}

// The name with each run of digits made one mark: "decoder.layers.#.self_attn.k_proj.bias".
std::string block_free(const std::string& name) {
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) {
      out += name[i];
    } else if (i == 0 || !std::isdigit(static_cast<unsigned char>(name[i - 1]))) {
      out += '#';
    }
  }
  return out;
}

// The batch or instance normalisation given `module`'s output straight (event
// module-input-from), which takes away each channel's mean: a bias of `module` adds the
// same value to every value it averages, so its gradient is zero in exact arithmetic (a
// GIN layer's Linear before its BatchNorm1d). Not a frozen one, which keeps its statistics.
const ModuleSummary* mean_removing_norm_after(const Run& run, const std::string& module) {
  for (const auto& [user, producer] : inputs_from(run)) {
    if (producer != module) continue;
    const ModuleSummary* norm = run.module_named(user);
    if (norm == nullptr) continue;
    const std::string& type = norm->info.module_type;
    if (type.rfind("BatchNorm", 0) == 0 || type.rfind("SyncBatchNorm", 0) == 0 || type.rfind("InstanceNorm", 0) == 0)
      return norm;
  }
  return nullptr;
}

// The same parameter in another block of the same structure whose gradient cancels on its
// own evidence, and its ratio: {null, 1} where none does.
std::pair<const LayerSummary*, double> cancelling_twin(const Run& run, const LayerSummary& layer,
                                                       double underflow_fraction) {
  const std::string shape = block_free(layer.info.name);
  if (shape == layer.info.name) return {nullptr, 1.0};
  for (const auto& other : run.layers) {
    if (&other == &layer || other.info.shape != layer.info.shape || block_free(other.info.name) != shape) continue;
    const auto [ratio, sibling] = below_siblings(run, other, underflow_fraction);
    if (own_cancels(ratio, sibling, sibling != nullptr ? input_rms(run, *sibling) : 0.0, products_only(run, sibling)))
      return {&other, ratio};
  }
  return {nullptr, 1.0};
}

// A bias with no sibling in range, its weight's gradient underflowing too: DETR's first
// encoder block at a scale its decoder holds at 256 (62 % of the key weight's values
// subnormal, the second block's 46 %). Alone that is a module the scale flushes; far below
// that weight all the same (under 1/128, where a true gradient sits at ~1 / |x|) and the
// twin of a bias that cancels on its own evidence, it is the same sum's rounding.
Cancellation beside_underflowing_weight(const Run& run, const LayerSummary& layer, double underflow_fraction,
                                        Cancellation c) {
  if (!bias_like(layer.info)) return c;
  const auto [ratio, sibling] = below_siblings(run, layer, underflow_fraction, true);
  if (sibling == nullptr || ratio >= 1.0 / 128.0) return c;
  const auto [twin, twin_ratio] = cancelling_twin(run, layer, underflow_fraction);
  if (twin == nullptr) return c;
  c.ratio = ratio;
  c.sibling = sibling;
  c.sibling_underflows = true;
  c.twin = twin;
  c.twin_ratio = twin_ratio;
  return c;
}

}  // namespace

bool Cancellation::cancels() const {
  return own_cancels(ratio, sibling, input, plain) || twin != nullptr || norm_after != nullptr;
}

Cancellation cancellation_of(const Run& run, const LayerSummary& layer, double underflow_fraction) {
  Cancellation c;
  std::tie(c.ratio, c.sibling) = below_siblings(run, layer, underflow_fraction);
  if (c.sibling != nullptr) c.input = input_rms(run, *c.sibling);
  c.plain = products_only(run, c.sibling);
  // A bias before a batch normalisation whose weight's gradient underflows too (no sibling
  // in range to set it against): far below that weight's all the same, and zero by the
  // structure, it is rounding.
  if (!own_cancels(c.ratio, c.sibling, c.input, c.plain) && bias_like(layer.info))
    if (const ModuleSummary* norm = mean_removing_norm_after(run, layer.info.module_path)) {
      const auto [ratio, sibling] = below_siblings(run, layer, underflow_fraction, true);
      if (sibling != nullptr && ratio < 1.0 / 512.0) {
        c.ratio = ratio;
        c.sibling = sibling;
        c.input = 0.0;
        c.plain = false;
        c.norm_after = norm;
        return c;
      }
    }
  // What makes a sum zero in exact arithmetic is the block's structure, which its repeats
  // share: Marian's first decoder block's key bias keeps more rounding (1/370 of its
  // weight's) than the second's (1/1090). A bias that truly underflows sits at ~1 / |x| of
  // its weight's, above 1/128 for inputs below RMS 128.
  if (c.sibling == nullptr) return beside_underflowing_weight(run, layer, underflow_fraction, c);
  if (own_cancels(c.ratio, c.sibling, c.input, c.plain) || c.ratio >= 1.0 / 128.0) return c;
  std::tie(c.twin, c.twin_ratio) = cancelling_twin(run, layer, underflow_fraction);
  return c;
}

}  // namespace ampdiag::analyzer::rules
