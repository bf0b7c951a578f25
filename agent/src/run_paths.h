// Where a process writes its run.db: one file per rank under torchrun (RANK/WORLD_SIZE).
#pragma once

#include <cstdint>
#include <string>

namespace ampdiag::agent {

struct RankInfo {
  std::int64_t rank = 0;
  std::int64_t world_size = 1;
};

// Reads RANK and WORLD_SIZE; throws std::invalid_argument naming a malformed variable.
RankInfo rank_from_environment();

// "run.db" -> "run.rank3.db" when world_size > 1; unchanged otherwise.
std::string rank_db_path(const std::string& path, const RankInfo& rank);

}  // namespace ampdiag::agent
