// What depends on the terminal: colour, the progress line, and writing an output file
// without leaving a half-written one behind.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ampdiag/analyzer/run.h"
#include "args.h"

namespace ampdiag::cli {

// --color auto|always|never; auto: stdout is a terminal and NO_COLOR is unset.
bool use_color(const Args& args);

// Loads each path (one per rank); prints progress on stderr when it is a terminal and
// the load takes a while.
std::vector<analyzer::Run> load_runs(const std::vector<std::string>& paths, bool allow_partial, int threads);

// Writes `text` to `path` (via a temporary file and rename), or to stdout when path is
// empty or "-". Throws UsageError naming the path if it cannot.
void write_output(const std::string& path, const std::string& text);

}  // namespace ampdiag::cli
