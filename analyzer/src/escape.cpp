// escape.h: one escaping function per destination.
#include "ampdiag/analyzer/escape.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <string_view>

namespace ampdiag::analyzer {

namespace {

std::string hex_byte(unsigned char c, const char* prefix) {
  char b[8];
  std::snprintf(b, sizeof b, "%s%02x", prefix, c);
  return b;
}

// The code point of a well-formed sequence of `n` bytes at s[i].
unsigned code_point(const std::string& s, std::size_t i, std::size_t n) {
  const auto b = [&](std::size_t k) { return unsigned(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return (b(0) & 0x1f) << 6 | (b(1) & 0x3f);
  if (n == 3) return (b(0) & 0x0f) << 12 | (b(1) & 0x3f) << 6 | (b(2) & 0x3f);
  return (b(0) & 0x07) << 18 | (b(1) & 0x3f) << 12 | (b(2) & 0x3f) << 6 | (b(3) & 0x3f);
}

bool control(unsigned cp) { return cp < 0x20 || (cp >= 0x7f && cp < 0xa0); }

std::size_t longest_backtick_run(const std::string& s) {
  std::size_t longest = 0, run = 0;
  for (char c : s) {
    run = c == '`' ? run + 1 : 0;
    longest = std::max(longest, run);
  }
  return longest;
}

}  // namespace

std::size_t utf8_sequence(const std::string& s, std::size_t i) {
  const auto at = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = at(0);
  std::size_t n;
  unsigned char lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size() || at(1) < lo || at(1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (at(k) < 0x80 || at(k) > 0xbf) return 0;
  return n;
}

std::string printable(const std::string& s, bool keep_newlines) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) {
      out += hex_byte(static_cast<unsigned char>(s[i]), "\\x");
      ++i;
      continue;
    }
    const unsigned cp = code_point(s, i, n);
    if (control(cp) && !(keep_newlines && cp == '\n'))
      out += hex_byte(static_cast<unsigned char>(cp), "\\x");  // controls are all below U+00A0
    else
      out.append(s, i, n);
    i += n;
  }
  return out;
}

std::size_t display_width(const std::string& text) {
  std::size_t width = 0;
  for (char c : text) width += (static_cast<unsigned char>(c) & 0xc0) != 0x80 ? 1 : 0;
  return width;
}

std::string markdown_text(const std::string& s) {
  std::string out;
  for (char c : printable(s)) {
    // What can start emphasis, code, a link, HTML, an entity or a table cell mid-line;
    // line-start syntax (#, -, +) cannot occur: the text is one line after a prefix.
    if (std::string_view("\\`*_[]<>&|~").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

std::string markdown_code(const std::string& s) {
  const std::string text = printable(s);
  const std::string fence(longest_backtick_run(text) + 1, '`');
  // A space inside the fence keeps a leading or trailing backtick from joining it.
  const bool pad = !text.empty() && (text.front() == '`' || text.back() == '`');
  return fence + (pad ? " " : "") + text + (pad ? " " : "") + fence;
}

std::string markdown_fence(const std::string& code) { return std::string(std::max<std::size_t>(3, longest_backtick_run(code) + 1), '`'); }

std::string python_string(const std::string& s) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) {
      out += "\\ufffd";
      ++i;
      continue;
    }
    const unsigned cp = code_point(s, i, n);
    if (cp == '"' || cp == '\\') out += std::string("\\") + char(cp);
    else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (cp == '\t') out += "\\t";
    else if (control(cp)) out += hex_byte(static_cast<unsigned char>(cp), "\\x");
    else out.append(s, i, n);
    i += n;
  }
  return out + "\"";
}

std::string cpp_string(const std::string& s) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (n == 0 || control(code_point(s, i, n))) {
      // Three octal digits always end the escape (a hex escape would swallow a following
      // hex digit); a C1 control is its UTF-8 bytes, each escaped.
      for (std::size_t k = 0; k < std::max<std::size_t>(n, 1); ++k) {
        char b[8];
        std::snprintf(b, sizeof b, "\\%03o", unsigned(static_cast<unsigned char>(s[i + k])));
        out += b;
      }
      i += std::max<std::size_t>(n, 1);
      continue;
    }
    if (c == '"' || c == '\\') out += '\\';
    out.append(s, i, n);
    i += n;
  }
  return out + "\"";
}

bool python_identifier(const std::string& s) {
  static const std::set<std::string> keywords = {
      "False", "None",   "True",    "and",      "as",   "assert", "async",  "await",    "break",
      "class", "continue", "def",   "del",      "elif", "else",   "except", "finally",  "for",
      "from",  "global", "if",      "import",   "in",   "is",     "lambda", "nonlocal", "not",
      "or",    "pass",   "raise",   "return",   "try",  "while",  "with",   "yield"};
  if (s.empty() || keywords.count(s)) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;  // ASCII identifiers only: safe
  }
  return true;
}

}  // namespace ampdiag::analyzer
