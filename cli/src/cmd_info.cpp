// ampdiag info: what a run.db holds, whether it is complete, and whether it is intact.
#include <cstdio>

#include "ampdiag/rundb/reader.h"
#include "commands.h"
#include "terminal.h"

namespace ampdiag::cli {

namespace {

constexpr const char* kHelp = R"(usage: ampdiag info RUN.db

Metadata (versions, device, AMP dtype, scaler settings, rank), row counts, whether the
run finished, and SQLite's integrity check. Exit 2 if the file is damaged.
)";

}  // namespace

int cmd_info(int argc, char** argv) {
  const Args args(argc, argv, {}, {});
  if (args.help()) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (args.positionals().size() != 1) throw UsageError("give exactly one run.db (see --help)");
  rundb::RunDbReader r(args.positionals().front());
  std::printf("file:            %s\n", r.path().c_str());
  std::printf("format:          run.db %d\n", r.schema_version());
  std::printf("state:           %s\n", r.finished() ? "finished" : "not finished (being written, or its process died)");
  const auto meta = r.meta();
  for (const auto& [k, v] : meta) std::printf("meta %-26s %s\n", (k + ":").c_str(), v.c_str());
  std::size_t grad_rows = 0;
  r.for_each_grad_stat([&](const rundb::GradStatRow&) { ++grad_rows; });
  std::printf("layers:          %zu\n", r.layers().size());
  std::printf("modules:         %zu\n", r.modules().size());
  std::printf("steps:           %zu\n", r.steps().size());
  std::printf("grad_stats rows: %zu\n", grad_rows);
  std::printf("act_stats rows:  %zu\n", r.act_stats().size());
  std::printf("events:          %zu\n", r.events().size());
  const std::string check = r.integrity_check();
  std::printf("integrity:       %s\n", check.c_str());
  if (check != "ok") throw rundb::RunDbError(r.path() + ": failed SQLite's integrity check: " + check);
  return 0;
}

}  // namespace ampdiag::cli
