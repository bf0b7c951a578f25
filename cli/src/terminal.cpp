// terminal.h: colour, progress, output files.
#include "terminal.h"

#include "ampdiag/analyzer/analyze.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace ampdiag::cli {

bool use_color(const Args& args) {
  const std::string mode = args.choice("--color", "auto", {"auto", "always", "never"});
  if (mode != "auto") return mode == "always";
  const char* term = std::getenv("TERM");
  return ::isatty(1) && !std::getenv("NO_COLOR") && !(term && std::strcmp(term, "dumb") == 0);
}

std::vector<analyzer::Run> load_runs(const std::vector<std::string>& paths, bool allow_partial, int threads) {
  std::vector<analyzer::Run> runs;
  const bool tty = ::isatty(2);
  for (const auto& path : paths) {
    analyzer::LoadOptions o;
    o.allow_unfinished = allow_partial;
    o.threads = threads;
    const auto start = std::chrono::steady_clock::now();
    bool shown = false;
    if (tty) {
      o.progress = [&](std::int64_t done, std::int64_t total) {
        if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500)) return;
        std::fprintf(stderr, "\rampdiag: reading %s: %lld%% of ~%lld M rows", path.c_str(),
                     (long long)(total > 0 ? std::min<std::int64_t>(100, done * 100 / total) : 0),
                     (long long)(total / 1000000));
        shown = true;
      };
    }
    runs.push_back(analyzer::load_run(path, o));
    if (shown) std::fprintf(stderr, "\r\033[K");
  }
  analyzer::check_one_run(runs);
  return runs;
}

void write_output(const std::string& path, const std::string& text) {
  if (path.empty() || path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    if (!out.good()) {
      std::remove(tmp.c_str());
      throw UsageError("cannot write " + path + ": " + std::strerror(errno));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw UsageError("cannot write " + path + ": " + std::strerror(errno));
  }
}

}  // namespace ampdiag::cli
