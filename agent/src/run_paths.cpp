// run_paths.h: per-rank file names.
#include "run_paths.h"

#include <cstdlib>
#include <stdexcept>

namespace ampdiag::agent {

namespace {

std::int64_t env_int(const char* name, std::int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < 0)
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + v +
                                "' is not a non-negative integer (torchrun sets it; unset it for a single process)");
  return n;
}

}  // namespace

RankInfo rank_from_environment() {
  RankInfo r;
  r.rank = env_int("RANK", 0);
  r.world_size = env_int("WORLD_SIZE", 1);
  if (r.world_size < 1) throw std::invalid_argument("WORLD_SIZE must be >= 1");
  if (r.rank >= r.world_size)
    throw std::invalid_argument("RANK=" + std::to_string(r.rank) + " is not below WORLD_SIZE=" + std::to_string(r.world_size));
  return r;
}

std::string rank_db_path(const std::string& path, const RankInfo& rank) {
  if (rank.world_size <= 1) return path;
  const std::string tag = ".rank" + std::to_string(rank.rank);
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot != std::string::npos && (slash == std::string::npos || dot > slash)) return path.substr(0, dot) + tag + path.substr(dot);
  return path + tag + ".db";
}

}  // namespace ampdiag::agent
