// Layer names cut to the heatmap's gutter and the layers table's column keep their end,
// where a model's dotted paths differ (Hugging Face T5's differ only after 30 characters).
#include <catch2/catch.hpp>

#include <string>

#include "fit_text.h"

using ampdiag::gui::fit_end;

namespace {

float seven_px(const std::string& s) { return 7.0f * float(s.size()); }  // a fixed-width font

}  // namespace

TEST_CASE("a name that fits is drawn whole", "[gui][fit]") {
  CHECK(fit_end("head.weight", 7 * 11, seven_px) == "head.weight");
}

TEST_CASE("a name too long keeps its end after an ellipsis, as much of it as fits", "[gui][fit]") {
  const std::string q = "encoder.block.0.layer.0.SelfAttention.q.weight";
  const std::string k = "encoder.block.0.layer.0.SelfAttention.k.weight";
  CHECK(fit_end(q, 7 * 20, seven_px) == "...ttention.q.weight");
  CHECK(fit_end(k, 7 * 20, seven_px) != fit_end(q, 7 * 20, seven_px));  // the rows stay apart
  CHECK(fit_end(q, 7 * 20 + 6, seven_px).size() == 20);  // a part of a character's width buys nothing
}

TEST_CASE("a width below the ellipsis's own gives nothing rather than spilling over", "[gui][fit]") {
  CHECK(fit_end("encoder.block.0", 7 * 2, seven_px).empty());
  CHECK(fit_end("encoder.block.0", 7 * 3, seven_px) == "...");
}
