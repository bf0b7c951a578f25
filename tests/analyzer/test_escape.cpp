// escape.h: a name escaped for each destination reads back as the name and cannot act as
// anything but text there.
#include <catch2/catch.hpp>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/json.h"

using namespace ampdiag::analyzer;

TEST_CASE("utf8_sequence accepts well-formed sequences and rejects overlong forms, surrogates and stray bytes", "[escape]") {
  REQUIRE(utf8_sequence("a", 0) == 1);
  REQUIRE(utf8_sequence("\xc3\xa9", 0) == 2);          // é
  REQUIRE(utf8_sequence("\xe2\x82\xac", 0) == 3);      // €
  REQUIRE(utf8_sequence("\xf0\x9f\x98\x80", 0) == 4);  // an emoji
  REQUIRE(utf8_sequence("\xc0\xaf", 0) == 0);          // overlong '/'
  REQUIRE(utf8_sequence("\xed\xa0\x80", 0) == 0);      // a UTF-16 surrogate
  REQUIRE(utf8_sequence("\xff", 0) == 0);
  REQUIRE(utf8_sequence("\xe2\x82", 0) == 0);          // cut short
}

TEST_CASE("printable shows control characters and broken UTF-8 as \\xNN and keeps the rest", "[escape]") {
  REQUIRE(printable("blocks.0.attn") == "blocks.0.attn");
  REQUIRE(printable("a\x1b[31mb") == "a\\x1b[31mb");
  REQUIRE(printable(std::string("a\0b\r", 4)) == "a\\x00b\\x0d");
  REQUIRE(printable("\xc2\x9b") == "\\x9b");  // C1 CSI, which some terminals obey
  REQUIRE(printable("caf\xc3\xa9\xff") == "caf\xc3\xa9\\xff");
  REQUIRE(printable("a\nb") == "a\\x0ab");
  REQUIRE(printable("a\nb", true) == "a\nb");
}

TEST_CASE("display_width counts code points, not bytes", "[escape]") {
  REQUIRE(display_width("caf\xc3\xa9") == 4);
}

TEST_CASE("markdown_code fences a name with more backticks than it holds in a row", "[escape]") {
  REQUIRE(markdown_code("blocks.0") == "`blocks.0`");
  REQUIRE(markdown_code("a``b") == "```a``b```");
  REQUIRE(markdown_code("`a") == "`` `a ``");
  REQUIRE(markdown_fence("x = 1") == "```");
  REQUIRE(markdown_fence("````") == "`````");
}

TEST_CASE("markdown_text escapes what Markdown reads as markup", "[escape]") {
  REQUIRE(markdown_text("a|b *c* [d](e) <f> _g_ `h` &amp;") == "a\\|b \\*c\\* \\[d\\](e) \\<f\\> \\_g\\_ \\`h\\` \\&amp;");
}

TEST_CASE("python_string escapes quotes, backslashes and controls and replaces broken UTF-8", "[escape]") {
  REQUIRE(python_string("a\"b\\c") == "\"a\\\"b\\\\c\"");
  REQUIRE(python_string("x\n\x1b") == "\"x\\n\\x1b\"");
  REQUIRE(python_string("\xff") == "\"\\ufffd\"");
  REQUIRE(python_string("caf\xc3\xa9") == "\"caf\xc3\xa9\"");
}

TEST_CASE("cpp_string uses three-digit octal escapes so a following digit stays a digit", "[escape]") {
  REQUIRE(cpp_string("\x1b" "1") == "\"\\0331\"");
  REQUIRE(cpp_string("a\"b\\") == "\"a\\\"b\\\\\"");
  REQUIRE(cpp_string("\xff") == "\"\\377\"");
  REQUIRE(cpp_string("\xc2\x85") == "\"\\302\\205\"");  // a C1 control: its bytes
}

TEST_CASE("python_identifier accepts names that can follow a dot", "[escape]") {
  REQUIRE(python_identifier("attn"));
  REQUIRE(python_identifier("_x1"));
  REQUIRE_FALSE(python_identifier("1x"));
  REQUIRE_FALSE(python_identifier("my layer"));
  REQUIRE_FALSE(python_identifier("class"));
  REQUIRE_FALSE(python_identifier(""));
}

TEST_CASE("json::quote writes valid JSON for NUL, controls and broken UTF-8", "[escape]") {
  REQUIRE(json::quote(std::string("a\0b", 3)) == "\"a\\u0000b\"");
  REQUIRE(json::quote("\r") == "\"\\r\"");
  REQUIRE(json::quote("caf\xc3\xa9\xff") == "\"caf\xc3\xa9\\ufffd\"");
}
