// A bias whose gradient is a sum that is zero in exact arithmetic (an attention key's bias
// under softmax, a bias just before a normalisation) is left with fp16's rounding: it looks
// like an underflow but is not the scale's to lift. The underflow rule asks here first.
#pragma once

#include "rules.h"

namespace ampdiag::analyzer::rules {

struct Cancellation {
  // Per element (RMS), the bias's gradient over the smallest in-range gradient of its module
  // at the same steps (1 where it has none), and that layer.
  double ratio = 1.0;
  const LayerSummary* sibling = nullptr;
  // What the sibling's module takes in per element, estimated from its outputs; 0 unknown.
  double input = 0.0;
  bool plain = false;  // the sibling's module is torch's Linear or convolution: that estimate holds at any size
  // The same parameter in another block of the same structure whose gradient cancels on its
  // own evidence, where this one's is far below its weight's yet not that far: null if none.
  const LayerSummary* twin = nullptr;
  double twin_ratio = 1.0;
  // The sibling's own gradient underflows: set against it only beside a twin that cancels.
  bool sibling_underflows = false;
  // The batch or instance normalisation given its module's output straight, which takes away
  // each channel's mean: the bias's sum is zero by that structure; null where none.
  const ModuleSummary* norm_after = nullptr;

  bool cancels() const;
};

Cancellation cancellation_of(const Run& run, const LayerSummary& layer, double underflow_fraction);

}  // namespace ampdiag::analyzer::rules
