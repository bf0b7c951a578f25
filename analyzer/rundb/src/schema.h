// Creating the run.db tables.
#pragma once

#include "sqlite.h"

namespace ampdiag::rundb {

void create_schema(Database& db);

}  // namespace ampdiag::rundb
