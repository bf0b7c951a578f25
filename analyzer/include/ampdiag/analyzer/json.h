// A minimal JSON writer: enough for the report, the tables and diff, with correct escaping
// and no NaN/Inf (written as null, which JSON can carry).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ampdiag::analyzer::json {

inline std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

inline std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char b[40];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

inline std::string number(std::int64_t v) { return std::to_string(v); }

}  // namespace ampdiag::analyzer::json
