// Modules whose own backward overflowed in the same skipped steps as the module
// overflow-origin names: its pin alone leaves those steps skipped (q beside k, two
// projections of one large input), so they are pinned with it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::rules {

// The modules outside `module` whose own backward overflowed in one of its skipped `steps`
// (ascending) as well: the agents judged the gradient reaching their output finite at that
// step, watched beside `module` (event "companion-output-gradient", "q: finite, beside k"), and one
// of their gradients held NaN/Inf there, so it was not `module`'s NaN/Inf passed on. In the
// order of those events, each once: the path, the step and that gradient.
struct OwnOverflow {
  std::string path;
  std::int64_t step = -1;
  std::string layer;
};
std::vector<OwnOverflow> own_overflows_beside(const Run& run, const std::string& module,
                                              const std::vector<std::int64_t>& steps);

// Where there are such modules: says so in `f`'s evidence, and in its title where `retitle`
// (`place`: how the title names `module`; a title that already says why, gradients too large
// for the scale, stays), and adds the fix that pins them with `module`. Returns whether it did.
bool pin_with_own_overflows(const Run& run, const std::string& module, const std::string& place,
                            const std::vector<std::int64_t>& steps, bool retitle, Finding& f);

}  // namespace ampdiag::analyzer::rules
