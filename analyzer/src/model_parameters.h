// The model's own parameters that its code after the modules reads (event "model-parameters",
// "logit_scale: 14.29 (float32, 1 value), read by Exp"). One read by exp() whose value alone
// takes exp() beyond the AMP dtype's range is where the overflow starts, and the operations
// after it only carry it: CLIP's temperature initialised at 1/0.07 instead of log(1/0.07),
// with no clamp, multiplies the similarities by 1.6e6.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer::model_parameters {

struct Read {
  std::string name;    // "logit_scale"
  double value = 0.0;  // its value where it holds one, else its largest |x|
  bool one_value = false;
  std::string reader;  // the operation that reads it: "Exp"
};

// The event's parameters, in its order; those whose text does not parse are left out.
std::vector<Read> parse(const std::string& detail);

// The fix that bounds the first one-value parameter read by Exp whose exp() passes the
// run's largest finite value; none where no parameter does.
std::optional<Suggestion> exp_bound(const Run& run, const std::string& detail);

// The fix that bounds the first one-value parameter read by Exp, in the code after `module`
// that sent NaN/Inf back into it (event "output-parameters"), whose exp() passes CLIP's bound
// of 100: a factor that large on the gradient that code sends back brings the loss scale
// down by as much. None where no parameter does.
std::optional<Suggestion> exp_factor_bound(const std::string& module, const std::string& detail);

}  // namespace ampdiag::analyzer::model_parameters
