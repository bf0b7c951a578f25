// The HTML report's "Top offenders": where each skipped step's NaN/Inf started, as the
// skipped-steps list says it (step_cause), not the layer a NaN loss reached first.
#include "rule_test.h"

namespace {

// The chart's SVG: from its title to the end of its <svg>.
std::string offenders_of(const std::string& page) {
  const auto at = page.find("Top offenders");
  if (at == std::string::npos) return "";
  return page.substr(at, page.find("</svg>", at) - at);
}

std::string page_of(const std::string& db) {
  const std::vector<Run> runs = {load_run(db)};
  return render_html(analyze(runs), Gate("error"), runs);
}

}  // namespace

TEST_CASE("the offenders of a run whose loss code goes NaN are the loss code's, not the head's gradient",
          "[render]") {
  // Every module's output finite, the loss NaN in every step: the head's gradient is the
  // first NaN in backward each time only because backward starts there.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("a", false).activation("head", false).step(scale, scale / 2, 1000, {"head.weight", "a.weight"}, kNaN);
  f.finish();
  const std::string chart = offenders_of(page_of(dir.file("run.db")));
  REQUIRE_FALSE(chart.empty());
  CHECK_THAT(chart, Catch::Contains("(the loss code)"));
  CHECK_THAT(chart, Catch::Contains("steps (first NaN/Inf, forward)"));
  CHECK_THAT(chart, !Catch::Contains("head.weight"));
}

TEST_CASE("the offenders of steps run on NaN parameters are the parameters", "[render]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.taken().activation("a", false).activation("head", false).step(1, 1, 1000, {"head.weight"});  // applied: no scaler
  for (int i = 0; i < 6; ++i)
    f.taken().activation("a", true).activation("head", true).step(1, 1, 1000, {"head.weight", "a.weight"}, kNaN);
  f.finish();
  const std::string chart = offenders_of(page_of(dir.file("run.db")));
  REQUIRE_FALSE(chart.empty());
  CHECK_THAT(chart, Catch::Contains("(the parameters)"));
}
