// How large a layer's gradients were without the loss scale (|g| / the scale it ran at), in
// the steps where they stayed finite: what overflow-origin weighs against the range the
// scale leaves them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "overflow_events.h"
#include "rules.h"

namespace ampdiag::analyzer::rules {

// The largest unscaled gradient (largest_true_gradient()) of the layers `module` was first in
// and of the others under it that fp16 holds, its step and its layer (-1: none). A module
// holding many layers (an LM's decoder stack, named where its first NaN/Inf gradient and the
// finite one before it meet) may be first by a layer whose gradients fit, while the ones too
// large for the scale are its other layers'.
struct TrueGradient {
  double value = 0.0;
  std::int64_t step = -1, layer = -1;
};
TrueGradient largest_true_gradient_of(const Run& run, const std::string& module,
                                      const std::map<std::int64_t, std::int64_t>& first_in,
                                      const std::map<std::int64_t, double>& scale_of, const Fp32Gradients& fp32);

// The layers outside `module` whose unscaled gradients, in the steps where they stayed
// finite, were above `limit` too, largest first: with them beyond it, pinning `module` alone
// leaves the scale where it is (a loss too large for every layer's gradients, not one
// layer's). Gradients computed in FP32 (gradient_made_in_fp32) are left out: they can pass
// 65504 without an fp16 backward.
std::vector<std::pair<std::string, double>> also_beyond(const Run& run, const std::string& module, double limit,
                                                        const std::map<std::int64_t, double>& scale_of,
                                                        const Fp32Gradients& fp32);

// The type of `module` where it is one of torch's own modules whose backward only multiplies
// and adds (Linear, the convolutions, Embedding): nothing in it makes NaN from finite values,
// so where it turns a finite gradient at its output into NaN/Inf at a loss scale of 1, its
// true gradients passed fp16's range. Empty otherwise (a custom module, a normalisation).
std::string products_only_type(const Run& run, const std::string& module);

// A normalisation that takes `module`'s output (it finished just after it, or after a module
// holding it) and normalised an input with next to no spread: its output all zeros in a step,
// or of an RMS below 1/8 of its weight's. A normalisation's backward divides by its input's
// spread, sqrt(eps) where that is 0, so `module`'s true gradients are that many times larger
// (DETR's first decoder layer normalises self-attention over queries of zeros: its output
// projection's bias takes gradients of 4960). `made` says what its output showed.
struct FlatNorm {
  const ModuleSummary* norm = nullptr;
  std::string made;
};
FlatNorm flat_normalisation_after(const Run& run, const std::string& module);

// The evidence that `flat` makes `module`'s gradients that large; empty where it has no norm.
std::string flat_norm_evidence(const FlatNorm& flat, const std::string& module);

// Where `norm` normalised an input with no spread and the model holds learned inputs that
// started at exactly zero (parameters of two or more dimensions named neither weight nor
// bias: BLIP-2's query_tokens, which Hugging Face initialises to zeros): their initialisation
// away from zero, untried. None where it holds none (DETR's queries are zeros made in forward).
std::optional<Suggestion> spread_zero_inputs(const Run& run, const ModuleSummary& norm);

// The smallest probed module below the model that holds `module` and every layer of `others`
// (names): pinned, all their fp16 backwards run in float32. Empty where only the model does,
// or where that module holds more than a quarter of the trained values.
std::string holding_all(const Run& run, const std::string& module,
                        const std::vector<std::pair<std::string, double>>& others);

// Says in `f`'s evidence that `others` (also_beyond's) passed the limit too (65504 where
// `at_any_scale`, else 65504 / `scale_floor`), so that `module`'s pin alone (`layer`'s where
// no module holds it) leaves theirs overflowing or the scale below the floor; and where one
// block holds them all (holding_all), adds its pin to `f`'s fixes.
void pin_beyond_others(const Run& run, const std::string& module, const std::string& layer,
                       const std::vector<std::pair<std::string, double>>& others, bool at_any_scale,
                       double scale_floor, Finding& f);

// The largest probed module that holds `module` and not `norm`, which takes its output: the
// block whose every backward the flat norm's gradient passes through (DETR's self-attention,
// whose output and value projections' biases both take it), at most a quarter of the
// trained values; `module` itself where none above it qualifies.
std::string block_before(const Run& run, const std::string& module, const ModuleSummary& norm);

}  // namespace ampdiag::analyzer::rules
