// Round axis ticks, shared by the HTML report's SVG plots and the GUI's plots.
#pragma once

namespace ampdiag::analyzer {

// The tick spacing: 1, 2 or 5 times a power of ten, giving about `target` ticks over
// `span`; with `integers`, at least 1 and whole (steps, powers of two).
double nice_step(double span, double target, bool integers);

}  // namespace ampdiag::analyzer
