// Escaping text for XML and HTML (the JUnit report, the HTML report and its SVG plots).
#pragma once

#include <string>

#include "ampdiag/analyzer/escape.h"

namespace ampdiag::analyzer {

// Control characters, which XML 1.0 forbids, and bytes that are not UTF-8 come out as
// visible \xNN (printable()).
inline std::string escape_markup(const std::string& text) {
  const std::string s = printable(text, true);
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace ampdiag::analyzer
