// Escaping text for XML and HTML (the JUnit report, the HTML report and its SVG plots).
#pragma once

#include <string>

namespace ampdiag::analyzer {

inline std::string escape_markup(const std::string& s) {
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
