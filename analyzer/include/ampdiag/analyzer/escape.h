// Names are data: a layer or module name comes from the user's model (or from a hostile
// file) and may hold anything: control bytes, terminal escape sequences, Markdown, quotes,
// bytes that are not UTF-8. Every output escapes it for where it goes.
#pragma once

#include <cstddef>
#include <string>

namespace ampdiag::analyzer {

// Length of the well-formed UTF-8 sequence starting at s[i] (1 to 4), or 0 when the byte
// there does not start one (overlong forms and surrogates are not well-formed).
std::size_t utf8_sequence(const std::string& s, std::size_t i);

// For a terminal or a plain-text file: control characters (C0, DEL, C1) and bytes that are
// not UTF-8 become visible \xNN (\n stays a line break with `keep_newlines`), so that no
// name can move the cursor, colour the screen or hide text.
std::string printable(const std::string& s, bool keep_newlines = false);

// Terminal columns of printable text: one per code point (no wide-character tables).
std::size_t display_width(const std::string& printable_text);

// One line of Markdown prose: printable(), with the punctuation that Markdown would read
// as markup backslash-escaped.
std::string markdown_text(const std::string& s);
// A Markdown code span: printable(), fenced by more backticks than the text holds in a row.
std::string markdown_code(const std::string& s);
// The fence for a fenced code block around `code`: at least ``` and longer than any run
// of backticks inside it.
std::string markdown_fence(const std::string& code);

// A double-quoted Python string literal whose value is `s` (bytes that are not UTF-8,
// which no Python str holds, become U+FFFD).
std::string python_string(const std::string& s);
// A C++ string literal whose bytes are `s`.
std::string cpp_string(const std::string& s);
// Whether `s` can follow a dot in Python (an identifier, not a keyword).
bool python_identifier(const std::string& s);

}  // namespace ampdiag::analyzer
