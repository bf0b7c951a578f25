// clip-before-unscale: gradients clipped while still multiplied by the loss scale keep the
// clip's norm before unscale in every step, whatever the scale (tests/scenarios/
// test_clipping.py runs the real loops, wrong and right).
#include "rule_test.h"

#include <cmath>

namespace {

// Each layer's norm when the four layers' total is max_norm.
double each(double max_norm) { return max_norm / std::sqrt(double(kLayers.size())); }

}  // namespace

TEST_CASE("gradients with one norm at every scale were clipped before unscale: an error that says to unscale first",
          "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 6; ++i) f.clipped(each(1.0)).step(65536, 65536);
  f.step(65536, 32768, 1000, {"head.weight"});
  for (int i = 0; i < 6; ++i) f.clipped(each(1.0)).step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "clip-before-unscale");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK(Gate("error").fails(r));
  CHECK_THAT(c->title, Catch::Contains("clipped while still multiplied by the loss scale"));
  CHECK_THAT(c->title, Catch::Contains("1 / scale (1.52588e-05 at 65536)"));
  CHECK_THAT(c->evidence, Catch::Contains("was 1 (within 0.01 %) in 12 of 12 steps"));
  CHECK_THAT(c->evidence, Catch::Contains("at loss scales 65536 down to 32768 alike"));
  REQUIRE_FALSE(c->suggestions.empty());
  CHECK_THAT(c->suggestions.front().python, Catch::Contains("scaler.unscale_(optimizer)"));
  CHECK_THAT(c->suggestions.front().python, Catch::Contains("max_norm=1)"));
  CHECK_THAT(c->suggestions.front().cpp, Catch::Contains("torch::nn::utils::clip_grad_norm_(model->parameters(), 1)"));
}

TEST_CASE("the HTML verdict says unstable layers come first only where a layer leads the findings",
          "[rules][clipping][render]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) f.clipped(each(1.0)).step(65536, 65536);
  f.finish();
  const std::vector<Run> runs = {load_run(dir.file("run.db"))};
  const Report r = analyze(runs);
  REQUIRE(r.findings.front().rule == "clip-before-unscale");
  const std::string page = render_html(r, Gate("error"), runs);
  CHECK_THAT(page, Catch::Contains("1 fails the gate (--fail-on error).</p>"));
  CHECK_THAT(page, !Catch::Contains("the unstable layers come first"));

  TempDir other;
  RunFixture g(other.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) g.step(scale, scale / 2, 1000, {"head.weight"});
  g.finish();
  const std::vector<Run> overflowing = {load_run(other.file("run.db"))};
  CHECK_THAT(render_html(analyze(overflowing), Gate("error"), overflowing),
             Catch::Contains("; the unstable layers come first.</p>"));
}

TEST_CASE("gradients whose norm moves with the batch were not clipped before unscale", "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) f.step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "clip-before-unscale") == nullptr);
}

TEST_CASE("a few steps whose norm happens to repeat are not a clip", "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) {
    if (i % 3 == 0) f.clipped(each(2.0));
    f.step(65536, 65536);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "clip-before-unscale") == nullptr);
}

TEST_CASE("without a scaler the statistics follow the clip: a fixed norm is the clip working", "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("amp_dtype", "bfloat16").meta("scaler_enabled", "0");
  for (int i = 0; i < 12; ++i) f.clipped(each(1.0)).step(1, 1);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "clip-before-unscale") == nullptr);
}

TEST_CASE("at a loss scale of 1 clipping the scaled gradients clips the true ones: no finding", "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) f.clipped(each(1.0)).step(1, 1);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "clip-before-unscale") == nullptr);
}

TEST_CASE("underflow of gradients clipped while scaled points to the clip, not to a higher scale", "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.zeros_fraction("b.weight", 0.5, 0.3);
  for (int i = 0; i < 12; ++i) f.clipped(each(1.0)).step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  REQUIRE(u->suggestions.size() == 1);
  CHECK_THAT(u->suggestions.front().summary, Catch::Contains("see clip-before-unscale"));
  CHECK(u->suggestions.front().python.empty());
}

TEST_CASE("one module's gradients with one norm at every scale were clipped alone before unscale", "[rules][clipping]") {
  // clip_grad_norm_(model.a.parameters(), 1) before scaler.unscale_(): a's total norm is
  // pinned, the others move with the batch.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  const double half = 1.0 / std::sqrt(2.0);
  for (int i = 0; i < 6; ++i) f.clipped(half, {"a.weight", "a.bias"}).step(65536, 65536);
  f.step(65536, 32768, 1000, {"head.weight"});
  for (int i = 0; i < 6; ++i) f.clipped(half, {"a.weight", "a.bias"}).step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "clip-before-unscale");
  REQUIRE(c != nullptr);
  CHECK(c->module == "a");
  CHECK_THAT(c->title, Catch::StartsWith("The gradients of a were clipped while still multiplied by the loss scale"));
  CHECK_THAT(c->evidence, Catch::Contains("the total norm of a's 2 gradients was 1 (within 0.01 %) in 12 of 12 steps"));
  CHECK_THAT(c->suggestions.front().python, Catch::Contains("clip_grad_norm_(model.a.parameters(), max_norm=1)"));
  CHECK_THAT(c->suggestions.front().cpp, Catch::Contains("clip_grad_norm_(model->named_modules()[\"a\"]->parameters(), 1)"));
}

TEST_CASE("a single gradient whose norm never moves is not taken for a clip", "[rules][clipping]") {
  // A parameter the loss adds as w.sum(): its gradient is the same every step.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) f.clipped(3.0, {"b.weight"}).step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "clip-before-unscale") == nullptr);
}

TEST_CASE("gradients whose abs-max and most values sit at one bound in every step were clipped by value before unscale",
          "[rules][clipping]") {
  // clip_grad_value_(model.parameters(), 1.0) on the scaled gradients: every value at ±1.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 6; ++i) f.clipped(std::sqrt(4096.0)).step(65536, 65536, 1.0);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "clip-before-unscale");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK_THAT(c->title, Catch::Contains("clipped by value while still multiplied by the loss scale"));
  CHECK_THAT(c->evidence, Catch::Contains("the largest |value| of each of the 4 gradients was 1 (within 0.01 %) in 6 of"));
  CHECK_THAT(c->suggestions.front().python, Catch::Contains(
      "scaler.unscale_(optimizer)  # the gradients' true values, before the clip\n"
      "torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=1)"));
  CHECK_THAT(c->suggestions.front().cpp, Catch::Contains("torch::nn::utils::clip_grad_value_(model->parameters(), 1)"));
}

TEST_CASE("gradients that share an abs-max with most values far below it were not clipped by value",
          "[rules][clipping]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 6; ++i) f.step(65536, 65536, 1.0);  // norms 10-20 of 4096 values: far below 64
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "clip-before-unscale") == nullptr);
}
