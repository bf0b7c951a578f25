// How every command that prints a table writes it: aligned text for people, CSV or JSON
// for scripts, to stdout or to the file -o/--output names.
#pragma once

#include <string>
#include <vector>

#include "args.h"

namespace ampdiag::cli {

// A CSV field, quoted (RFC 4180) only when it has to be.
std::string csv_field(const std::string& s);

// rows[0] is the header. An empty table still prints its header (text, CSV) or `[]` (JSON);
// JSON values are strings, as the text shows them.
std::string render_table(const std::vector<std::vector<std::string>>& rows, const std::string& format);

// --format text|csv|json, with --csv as a short form of --format csv.
std::string table_format(const Args& args);

// -o or --output; empty for stdout.
std::string output_path(const Args& args);

}  // namespace ampdiag::cli
