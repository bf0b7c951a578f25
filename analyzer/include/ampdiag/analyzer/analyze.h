// Runs the rules over one run or several ranks of one run.
#pragma once

#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

// Every rule id, in the order the report lists them.
const std::vector<std::string>& rule_ids();

Report analyze(const std::vector<Run>& runs, const Thresholds& thresholds = {});

}  // namespace ampdiag::analyzer
