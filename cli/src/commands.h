// The `ampdiag` subcommands. Each returns the process exit code: 0 healthy or done,
// 1 findings that fail the gate (or a regression), and throws UsageError or
// rundb::RunDbError for exit code 2.
#pragma once

namespace ampdiag::cli {

int cmd_report(int argc, char** argv);
int cmd_layers(int argc, char** argv);
int cmd_timeline(int argc, char** argv);
int cmd_diff(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_info(int argc, char** argv);
int cmd_whatif(int argc, char** argv);
int cmd_fp8(int argc, char** argv);

}  // namespace ampdiag::cli
