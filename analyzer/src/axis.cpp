// axis.h: round tick spacing.
#include "ampdiag/analyzer/axis.h"

#include <algorithm>
#include <cmath>

namespace ampdiag::analyzer {

double nice_step(double span, double target, bool integers) {
  if (!(span > 0)) span = 1;
  const double raw = span / target, magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * magnitude;
  for (double m : {1.0, 2.0, 5.0})
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  return integers ? std::max(1.0, std::round(step)) : step;
}

}  // namespace ampdiag::analyzer
