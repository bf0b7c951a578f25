// The fixes that lead a finding whose gradients are too large for the loss scale: shrink the
// loss where it is made, and first re-initialise the weights that make the outputs that large.
#pragma once

#include <cstdint>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// Adds them to `f`: `losses` are the finite recorded losses of the skipped `steps`
// (ascending) that the finding's module overflowed first in, and `excess` how many times
// its largest unscaled gradient exceeds what the scale can hold.
void shrink_the_loss(const Run& run, const std::vector<double>& losses, const std::vector<std::int64_t>& steps,
                     double excess, Finding& f);

}  // namespace ampdiag::analyzer::rules
