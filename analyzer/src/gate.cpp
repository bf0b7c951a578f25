// Gate: which findings make `ampdiag report` exit 1.
#include <sstream>
#include <stdexcept>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/render.h"

namespace ampdiag::analyzer {

Gate::Gate(const std::string& spec) : spec_(spec) {
  if (spec == "error") {
    errors_ = true;
  } else if (spec == "all") {
    all_ = true;
  } else if (spec == "none") {
    none_ = true;
  } else {
    std::stringstream list(spec);
    for (std::string rule; std::getline(list, rule, ',');) {
      bool known = false;
      for (const auto& id : rule_ids()) known = known || id == rule;
      if (!known) {
        std::string ids;
        for (const auto& id : rule_ids()) ids += " " + id;
        throw std::invalid_argument("--fail-on: unknown rule '" + rule + "' (rules:" + ids + "; or error, all, none)");
      }
      rules_.insert(rule);
    }
    if (rules_.empty()) throw std::invalid_argument("--fail-on: give rule ids, or error, all, none");
  }
}

bool Gate::fails(const Finding& f) const {
  if (none_ || f.severity == Severity::kInfo) return false;
  if (all_) return true;
  if (errors_) return f.severity == Severity::kError;
  return rules_.count(f.rule) != 0;
}

bool Gate::fails(const Report& r) const {
  for (const auto& f : r.findings)
    if (fails(f)) return true;
  return false;
}

}  // namespace ampdiag::analyzer
