// What the analyzer's rule tests share: the layers of their fixtures, a NaN loss, the
// report of one run.db, and a finding by rule (and layer).
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "ampdiag/analyzer/analyze.h"

namespace ampdiag::test::rule_checks {

inline const std::vector<std::string> kLayers = {"a.weight", "a.bias", "b.weight", "head.weight"};
inline const double kNaN = std::numeric_limits<double>::quiet_NaN();

inline analyzer::Report report_of(const std::string& path) { return analyzer::analyze({analyzer::load_run(path)}); }

inline const analyzer::Finding* find(const analyzer::Report& r, const std::string& rule) {
  for (const auto& f : r.findings)
    if (f.rule == rule) return &f;
  return nullptr;
}
// A pointer into a temporary Report dangles at the end of the statement (ASan found three).
const analyzer::Finding* find(analyzer::Report&& r, const std::string& rule) = delete;

// The finding of `rule` that names `layer` (one rule may name several layers), or null.
inline const analyzer::Finding* find(const analyzer::Report& r, const std::string& rule, const std::string& layer) {
  for (const auto& f : r.findings)
    if (f.rule == rule && f.layer == layer) return &f;
  return nullptr;
}
const analyzer::Finding* find(analyzer::Report&& r, const std::string& rule, const std::string& layer) = delete;

}  // namespace ampdiag::test::rule_checks
