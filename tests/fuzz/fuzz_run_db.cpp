// Fuzz target: any bytes as a run.db, through everything `ampdiag report` does with one
// (the reader, the loader, the rules, every renderer). The only acceptable failure is a
// RunDbError (a clear one-line "cannot read this"); a crash, a sanitizer report, another
// exception, a hang or a runaway allocation is a bug. Built as a libFuzzer binary
// (AMPDIAG_FUZZ=ON, clang) and as a replayer of tests/fuzz/regressions/ that ctest runs.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/render.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/rows.h"

namespace {

const std::string& scratch_path() {
  static const std::string path = "/tmp/ampdiag-fuzz-" + std::to_string(::getpid()) + ".db";
  return path;
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
