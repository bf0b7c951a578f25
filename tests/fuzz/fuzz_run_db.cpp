// Fuzz target: any bytes as a run.db, through everything `ampdiag report` does with one
// (the reader, the loader, the rules, every renderer). The only acceptable failure is a
// RunDbError (a clear one-line "cannot read this"); a crash, a sanitizer report, another
// exception, a hang or a runaway allocation is a bug. Built as a libFuzzer binary
// (AMPDIAG_FUZZ=ON, clang) and as a replayer of tests/fuzz/regressions/ that ctest runs.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/render.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/rows.h"

namespace {

// The file every input is written to, in a directory of the process's own under $TMPDIR
// (else /tmp) that goes, with SQLite's side files, when the process exits: the replayer runs
// in every ctest build and each run of it left a run.db behind.
class Scratch {
 public:
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    std::string name = std::string(tmp && *tmp ? tmp : "/tmp") + "/ampdiag-fuzz-XXXXXX";
    if (!::mkdtemp(name.data())) {
      std::perror(("ampdiag fuzz: cannot create a scratch directory " + name).c_str());
      std::abort();
    }
    dir_ = name;
    path_ = dir_ + "/run.db";
  }
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
};

const std::string& scratch_path() {
  static const Scratch scratch;
  return scratch.path();
}

void write_file(const std::string& path, const std::uint8_t* data, std::size_t size) {
  for (const char* suffix : {"-wal", "-shm", "-journal"}) ::unlink((path + suffix).c_str());
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ampdiag;
  const std::string& path = scratch_path();
  write_file(path, data, size);
  try {
    analyzer::LoadOptions options;
    options.threads = 1;
    options.allow_unfinished = true;
    std::vector<analyzer::Run> runs;
    runs.push_back(analyzer::load_run(path, options));
    const analyzer::Report report = analyzer::analyze(runs);
    const analyzer::Gate gate("error");
    analyzer::render_text(report, gate, {});
    analyzer::render_markdown(report, gate);
    analyzer::render_json(report, gate);
    analyzer::render_junit(report, gate);
    analyzer::render_html(report, gate, runs);
  } catch (const rundb::RunDbError&) {
    // The one expected outcome for a bad file.
  }
  return 0;
}
