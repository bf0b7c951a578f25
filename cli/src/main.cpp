// ampdiag: reads run.db files written by the ampdiag agent and says which layers break
// mixed-precision training, why, and what to do. See `ampdiag --help`.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/rundb/rows.h"
#include "ampdiag/rundb/schema.h"
#include "args.h"
#include "commands.h"

namespace {

constexpr const char* kUsage = R"(ampdiag: find the layer that breaks mixed-precision training.

usage: ampdiag COMMAND [options] ...

commands:
  report RUN.db [RUN.db ...]   the unstable layers, with evidence and the fix (exit 1 if the gate fails)
  layers RUN.db                per-layer table
  timeline RUN.db              per-step table (loss, scale, skipped, cause)
  diff BASE.db NEW.db          what got worse between two runs (exit 1 on a regression)
  export RUN.db                a table as CSV or JSON
  info RUN.db                  metadata, counts, integrity
  whatif RUN.db                the run's gradients through another loss-scaler configuration
  fp8 RUN.db                   which layers' gradients would fit E4M3 / E5M2 under delayed scaling

`ampdiag COMMAND --help` describes each. Exit codes: 0 healthy, 1 findings that fail the
gate, 2 usage or input error.
)";

}  // namespace

int main(int argc, char** argv) {
  using namespace ampdiag::cli;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("ampdiag 0.1.0 (writes run.db format %d, reads formats 1 to %d)\n", ampdiag::rundb::kSchemaVersion,
                ampdiag::rundb::kSchemaVersion);
    return 0;
  }
  const std::string command = argv[1];
  try {
    if (command == "report") return cmd_report(argc - 2, argv + 2);
    if (command == "layers") return cmd_layers(argc - 2, argv + 2);
    if (command == "timeline") return cmd_timeline(argc - 2, argv + 2);
    if (command == "diff") return cmd_diff(argc - 2, argv + 2);
    if (command == "export") return cmd_export(argc - 2, argv + 2);
    if (command == "info") return cmd_info(argc - 2, argv + 2);
    if (command == "whatif") return cmd_whatif(argc - 2, argv + 2);
    if (command == "fp8") return cmd_fp8(argc - 2, argv + 2);
    std::fprintf(stderr, "ampdiag: unknown command '%s' (commands: report, layers, timeline, diff, export, info, whatif, fp8)\n",
                 ampdiag::analyzer::printable(command).c_str());
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "ampdiag %s: %s\n", command.c_str(), ampdiag::analyzer::printable(e.what(), true).c_str());
    return 2;
  } catch (const ampdiag::rundb::RunDbError& e) {
    std::fprintf(stderr, "ampdiag %s: %s\n", command.c_str(), ampdiag::analyzer::printable(e.what(), true).c_str());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "ampdiag %s: out of memory\n", command.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ampdiag %s: %s\n", command.c_str(), ampdiag::analyzer::printable(e.what(), true).c_str());
    return 2;
  }
}
