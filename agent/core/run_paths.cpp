// run_paths.h: per-rank file names.
#include "run_paths.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
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

std::string env_text(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string hex64(std::uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// FNV-1a: stable across processes and builds, unlike std::hash.
std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Field 22 of /proc/PID/stat: the process's start time, so that a reused pid differs.
std::string process_start(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return "";
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  return field;
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

namespace ampdiag::agent {

std::string default_run_id(const RankInfo& rank) {
  if (rank.world_size <= 1) {
    std::random_device device;
    const auto now = std::uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    return hex64((std::uint64_t(device()) << 32 ^ device()) ^ now * 0x9e3779b97f4a7c15ull);
  }
  std::string key = "torchelastic=" + env_text("TORCHELASTIC_RUN_ID") + " master=" + env_text("MASTER_ADDR") + ":" +
                    env_text("MASTER_PORT") + " world=" + std::to_string(rank.world_size) +
                    " restart=" + env_text("TORCHELASTIC_RESTART_COUNT");
  const std::string local = env_text("LOCAL_WORLD_SIZE");
  if (local.empty() || local == std::to_string(rank.world_size)) {
    const pid_t parent = ::getppid();
    key += " launcher=" + std::to_string(parent) + "@" + process_start(parent);
  }
  return hex64(fnv1a(key));
}

}  // namespace ampdiag::agent
