// Tables as aligned text, CSV or JSON.
#include "table_output.h"

#include <algorithm>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/json.h"

namespace ampdiag::cli {

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}

std::string render_table(const std::vector<std::vector<std::string>>& rows, const std::string& format) {
  std::string out;
  if (format == "csv") {
    for (const auto& r : rows) {
      for (std::size_t i = 0; i < r.size(); ++i) out += (i ? "," : "") + csv_field(r[i]);
      out += "\n";
    }
    return out;
  }
  if (format == "json") {
    out = "[";
    for (std::size_t k = 1; k < rows.size(); ++k) {
      out += k > 1 ? ",\n {" : "\n {";
      for (std::size_t i = 0; i < rows[k].size(); ++i) out += (i ? ", " : "") + analyzer::json::quote(rows[0][i]) + ": " + analyzer::json::quote(rows[k][i]);
      out += "}";
    }
    return out + "\n]\n";
  }
  // Text is for a terminal: names are data, and no cell may drive it (escape.h).
  std::vector<std::vector<std::string>> cells = rows;
  std::vector<std::size_t> width;
  for (auto& r : cells)
    for (std::size_t i = 0; i < r.size(); ++i) {
      r[i] = analyzer::printable(r[i]);
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], analyzer::display_width(r[i]));
    }
  for (const auto& r : cells) {
    std::string line;
    for (std::size_t i = 0; i < r.size(); ++i) {
      line += (i ? "  " : "") + r[i];
      line.append(width[i] - analyzer::display_width(r[i]), ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string table_format(const Args& args) {
  if (args.flag("--csv")) return "csv";
  return args.choice("--format", "text", {"text", "csv", "json"});
}

std::string output_path(const Args& args) { return args.has("-o") ? args.value("-o") : args.value("--output"); }

}  // namespace ampdiag::cli
