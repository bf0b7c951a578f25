// The HTML report's plots: "Top offenders" says where each skipped step's NaN/Inf started,
// as the skipped-steps list says it (step_cause), not the layer a NaN loss reached first;
// a series with one finite point is drawn as a dot, and a run of one step is centred; a
// report of ranks shows the layers of the rank a finding names.
#include "rule_test.h"

namespace {

// A chart's SVG: from its title to the end of its <svg>.
std::string chart_of(const std::string& page, const std::string& title) {
  const auto at = page.find(title);
  if (at == std::string::npos) return "";
  return page.substr(at, page.find("</svg>", at) - at);
}

// The value of attribute `name` in the first element of `svg` that has it, or "".
std::string attribute(const std::string& svg, const std::string& name, std::size_t from = 0) {
  const std::string key = " " + name + "=\"";
  const auto at = svg.find(key, from);
  if (at == std::string::npos) return "";
  const auto begin = at + key.size();
  return svg.substr(begin, svg.find('"', begin) - begin);
}

std::string offenders_of(const std::string& page) { return chart_of(page, "Top offenders"); }

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

TEST_CASE("a layer whose gradient was finite in one step only is a dot in the L2 plot", "[render]") {
  // Every other step's gradients NaN/Inf: its norm after unscale is known once.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 8; ++i, scale /= 2) {
    if (i == 3)
      f.step(scale, scale);
    else
      f.step(scale, scale / 2, 1000, kLayers);
  }
  f.finish();
  const std::string chart = chart_of(page_of(dir.file("run.db")), "Gradient L2 norm");
  REQUIRE_FALSE(chart.empty());
  CHECK_THAT(chart, Catch::Contains("<circle class=\"dot\""));
  CHECK_THAT(chart, !Catch::Contains("h0.01"));
}

TEST_CASE("a run of one step draws its dot under the step's tick, not on the y axis", "[render]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 65536);
  f.finish();
  const std::string chart = chart_of(page_of(dir.file("run.db")), "Gradient L2 norm");
  REQUIRE_FALSE(chart.empty());
  const auto dot = chart.find("<circle class=\"dot\"");
  REQUIRE(dot != std::string::npos);
  const auto step_tick = chart.find("text-anchor=\"middle\">0</text>");
  REQUIRE(step_tick != std::string::npos);
  const std::string tick_x = attribute(chart, "x", chart.rfind("<text", step_tick));
  CHECK(attribute(chart, "cx", dot) == tick_x);
  CHECK(std::stod(tick_x) > 64.0 + 100);  // the plot's left edge is at 64
  CHECK_THAT(chart, !Catch::Contains("text-anchor=\"middle\">1</text>"));
}

TEST_CASE("a report of ranks shows the layers of the rank a finding names, even an information one", "[render]") {
  // FSDP1: rank 1 alone holds 4.bias, whose gradient overflowed once (a calibration skip).
  TempDir dir;
  {
    RunFixture r0(dir.file("run.rank0.db"), {"0.weight", "2.weight"}, 0, 2);
    RunFixture r1(dir.file("run.rank1.db"), {"2.weight", "4.bias"}, 1, 2);
    for (int i = 0; i < 10; ++i) {
      if (i == 0) r0.skipped_for_another_rank();
      r0.step(i == 0 ? 65536 : 32768, 32768);
      r1.step(i == 0 ? 65536 : 32768, 32768, 1000, i == 0 ? std::vector<std::string>{"4.bias"} : std::vector<std::string>{});
    }
    r0.finish();
    r1.finish();
  }
  const std::vector<Run> runs = {load_run(dir.file("run.rank0.db")), load_run(dir.file("run.rank1.db"))};
  const std::string page = render_html(analyze(runs), Gate("error"), runs);
  const auto layers = page.find("<h2>Layers (rank 1)</h2>");
  REQUIRE(layers != std::string::npos);
  CHECK(page.find("<code>4.bias</code>", layers) < page.find("<h2>Findings</h2>"));
}
