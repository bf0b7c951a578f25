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

// The id every rank of one run shares (meta run_id), so that a reader never merges ranks
// of different runs. One process: random. Several: derived from what the launcher gives
// every rank alike (torchrun's run id, the rendezvous address and port, the world size,
// and on one node the launcher process and its start time), so ranks agree without
// talking to each other.
std::string default_run_id(const RankInfo& rank);

}  // namespace ampdiag::agent
