// Creating the run.db tables.
#pragma once

#include <string>

#include "sqlite.h"

namespace ampdiag::rundb {

void create_schema(Database& db);

// "numel, nan, ..., l2": the statistic columns of grad_stats and act_stats, in order.
std::string stat_column_list();

}  // namespace ampdiag::rundb
