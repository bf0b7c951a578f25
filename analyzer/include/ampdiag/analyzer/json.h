// A minimal JSON writer: enough for the report, the tables and diff, with correct escaping
// and no NaN/Inf (written as null, which JSON can carry).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/escape.h"

namespace ampdiag::analyzer::json {

// A JSON string: every byte that JSON or UTF-8 cannot carry as it is escaped; bytes that
// are not UTF-8 become U+FFFD (JSON text is UTF-8).
inline std::string quote(const std::string& s) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const std::size_t n = utf8_sequence(s, i);
      if (n == 0) {
        out += "\\ufffd";
      } else {
        out.append(s, i, n);
        i += n - 1;
      }
      continue;
    }
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
