// The fixes that lead a finding whose gradients are too large for the loss scale: shrink the
// loss where it is made, and first re-initialise the weights that make the outputs that large.
#pragma once

#include <cstdint>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// Whether a loss of this size makes a gradient this large itself. Its gradients at the
// model's output are of the order of |loss| where a factor or a sum over the batch makes it
// (c times the loss, c times the gradients) and of 2 sqrt(|loss|) for a squared error, and a
// weight's multiplies them by its inputs (a few units after a normalisation): 16 times the
// larger of the two bounds what it explains. A cross-entropy around 3 explains no gradient
// beyond 65504 / 128 (a gradient reversal of 1e5 in a DANN, MobileOne's scale branch before a
// BatchNorm); one times 1e6, a sum over the batch or an autoencoder's loss on raw pixels does.
bool loss_explains(double loss, double gradient);

// The same through the loss's square root alone (16 sqrt(|loss|)): a squared error's large
// residuals, which make the gradient at the model's output that large whatever the code
// after a module does. A loss in proportion to the gradient may itself be the work of a gain
// in that code, which enlarges both (a temperature's exp() multiplies the logits, so the
// cross-entropy, and their gradient alike: CLIP's logit scale at 11.5).
bool residuals_explain(double loss, double gradient);

// Adds them to `f`: `losses` are the finite recorded losses of the skipped `steps`
// (ascending) that the finding's module overflowed first in, `gradient` its largest unscaled
// gradient and `excess` how many times that exceeds what the scale can hold. Where the loss
// does not explain the gradient, shrinking it would only do what a lower scale does: the
// evidence says so, and no fix is added.
void shrink_the_loss(const Run& run, const std::vector<double>& losses, const std::vector<std::int64_t>& steps,
                     double gradient, double excess, Finding& f);

}  // namespace ampdiag::analyzer::rules
