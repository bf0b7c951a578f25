// A module called again and again in one forward (a hand-written recurrence, ALBERT's shared
// block, a layer reused by hand) that went NaN/Inf first: how its |output| grew call after
// call and which call went NaN/Inf (ModuleSummary::growth). A steady growth is its state
// amplified, which FP32 only postpones, so bounding it comes before any pin.
#pragma once

#include <string>

#include "ampdiag/analyzer/causes.h"
#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// The growth of a module whose |output| rose by a steady factor call after call in one
// forward until it went NaN/Inf (a hand-written recurrence, a weight-shared layer run again
// and again): its state is amplified, and FP32 only postpones the overflow. Null: none.
const CallGrowth* recurrence(const Run& run, const ForwardCause& cause);

// A module run several times in one forward whose outputs did not grow steadily (ALBERT's
// shared block, a layer reused by hand): which call went NaN/Inf says where in the forward
// it happened. Empty where it ran once, or no forward with a row for every call showed it.
std::string repeated_calls(const Run& run, const ForwardCause& cause);

// Says how `name`'s output grew (evidence), retitles the finding, and puts bounding the
// recurrence before the pins, which only postpone the overflow.
void recurrence_fixes(const Run& run, const std::string& name, const CallGrowth& g, Finding& f);

}  // namespace ampdiag::analyzer::rules
