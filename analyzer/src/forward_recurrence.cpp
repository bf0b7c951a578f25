// Recurrences and repeated calls in a forward; see forward_recurrence.h.
#include "forward_recurrence.h"

#include <cmath>

#include "rules.h"

namespace ampdiag::analyzer::rules {

namespace {

// Its |output| at its last call in that forward had it kept growing at that rate, as FP32 would let it.
double projected_last(const CallGrowth& g) {
  return double(g.to) * std::pow(g.rate(), double(g.calls - 1 - g.to_call));
}

}  // namespace

const CallGrowth* recurrence(const Run& run, const ForwardCause& cause) {
  if (cause.intrinsic || cause.own_code || cause.module.empty() || cause.module != cause.first_seen) return nullptr;
  const ModuleSummary* m = run.module_named(cause.module);
  return m && m->growth.grows() ? &m->growth : nullptr;
}

std::string repeated_calls(const Run& run, const ForwardCause& cause) {
  if (cause.intrinsic || cause.own_code || cause.module.empty() || cause.module != cause.first_seen) return "";
  const ModuleSummary* m = run.module_named(cause.module);
  if (!m || m->growth.calls < 2 || m->growth.nonfinite_call < 0) return "";
  const CallGrowth& g = m->growth;
  std::string said = "it ran " + std::to_string(g.calls) + " times in step " + std::to_string(g.step) +
                     "'s forward and went NaN/Inf at call " + std::to_string(g.nonfinite_call + 1);
  if (g.nonfinite_call == 0) return said + ", its first";
  if (g.to_call + 1 != g.nonfinite_call) return said;
  said += ", after an |output| of ";
  if (g.from_call < g.to_call) said += three_digits(g.from) + " at call " + std::to_string(g.from_call + 1) + " and ";
  return said + three_digits(g.to) + " at call " + std::to_string(g.to_call + 1);
}

void recurrence_fixes(const Run& run, const std::string& name, const CallGrowth& g, Finding& f) {
  const std::string rate = three_digits(g.rate());
  f.title = name + "'s output grows about " + rate + "x with each of its calls in a forward, and overflows fp16 at call " +
            std::to_string(g.nonfinite_call + 1) + " of " + std::to_string(g.calls);
  f.evidence += "; in step " + std::to_string(g.step) + "'s forward it ran " + std::to_string(g.calls) +
                " times: its |output| rose from " + three_digits(g.from) + " at call " + std::to_string(g.from_call + 1) +
                " to " + three_digits(g.to) + " at call " + std::to_string(g.to_call + 1) + " (above the call before in " +
                std::to_string(g.rises) + " of " + std::to_string(g.to_call - g.from_call) + "), about " + rate +
                "x a call, then went NaN/Inf at call " + std::to_string(g.nonfinite_call + 1);
  const std::int64_t after = g.calls - 1 - g.nonfinite_call;
  const double last = projected_last(g);
  const bool beyond = after > 0 && last > run.fp_max;
  std::string pinned;
  if (beyond)
    pinned = " Pinned to FP32, it would go on growing for " + plural(after, "more call") + " in that forward, to about " +
             three_digits(last) + " by its last: beyond fp16's range again, for whatever uses it in fp16.";
  Suggestion bound;
  bound.summary = "Keep the state that " + name + " is called on from growing: its output grows about " + rate +
                  "x a call, so it overflows wherever its calls run long enough, and FP32 only postpones it." + pinned +
                  " Bound it each call: a saturating nonlinearity on the state (tanh, as nn.RNN has), a LayerNorm on "
                  "it, or recurrent weights with a gain below 1 (orthogonal or spectral-norm initialisation); clipping "
                  "gradients does not bound the forward.";
  const std::string own = name.substr(name.rfind('.') + 1);  // the attribute its caller holds it as
  bound.python = "# where a forward() calls " + name + " once per step of the sequence:\n"
                 "h = torch.tanh(self." + own + "(h) + u)  # bounded in (-1, 1), as nn.RNN's state\n"
                 "# or normalise it each step: h = self.norm(...), with self.norm = nn.LayerNorm(hidden_size)";
  bound.cpp = "// where a forward() calls " + name + " once per step of the sequence:\n"
              "h = torch::tanh(" + own + "->forward(h) + u);  // bounded in (-1, 1)";
  bound.untried = true;
  for (Suggestion& fix : f.suggestions)
    if (fix.python.find("ampdiag.pin_fp32") != std::string::npos) {
      fix.untried = true;
      fix.summary += " The growth goes on in FP32" + std::string(beyond ? ", and beyond fp16's range by its last call." : ".");
    }
  f.suggestions.insert(f.suggestions.begin(), bound);
}

}  // namespace ampdiag::analyzer::rules
