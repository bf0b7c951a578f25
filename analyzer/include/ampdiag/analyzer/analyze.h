// Runs the rules over one run or several ranks of one run.
#pragma once

#include <string>
#include <vector>

#include "ampdiag/analyzer/findings.h"
#include "ampdiag/analyzer/run.h"

namespace ampdiag::analyzer {

// Every rule id, in the order the report lists them.
const std::vector<std::string>& rule_ids();

// Throws rundb::RunDbError (one line) unless the runs are distinct ranks of one run: the
// same file twice, two files of one rank, or files of different runs (run id, world size).
void check_one_run(const std::vector<Run>& runs);

Report analyze(const std::vector<Run>& runs, const Thresholds& thresholds = {});

}  // namespace ampdiag::analyzer
