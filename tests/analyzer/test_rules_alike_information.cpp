// underflow's information findings alike, exact zeros and gradients that cancel to rounding:
// three or more are one finding, as the warnings alike already were (test_rules_underflow.cpp).
#include <algorithm>

#include "rule_test.h"

namespace {

std::int64_t alike_count(const Report& r, const std::string& rule) {
  return std::count_if(r.findings.begin(), r.findings.end(), [&](const Finding& f) { return f.rule == rule; });
}

}  // namespace

namespace {

// `blocks` convolutions c0..cN, each a bias whose gradient cancels before a normalisation
// (95 % fp16-subnormal, 1e-4 of its weight's per element) beside its weight's.
Report cancelled_biases_run(const TempDir& dir, int blocks) {
  std::vector<std::string> layers;
  for (int i = 0; i < blocks; ++i) {
    layers.push_back("c" + std::to_string(i) + ".weight");
    layers.push_back("c" + std::to_string(i) + ".bias");
  }
  RunFixture f(dir.file("run.db"), layers);
  std::vector<std::string> biases;
  for (int i = 0; i < blocks; ++i) {
    f.zeros_fraction("c" + std::to_string(i) + ".bias", 0.0, 0.95);
    biases.push_back("c" + std::to_string(i) + ".bias");
  }
  for (int step = 0; step < 10; ++step) f.clipped(1e-4, biases).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("three or more biases that cancel to rounding are one information finding", "[rules]") {
  // A style-transfer network's eight convolution biases, each before an InstanceNorm.
  TempDir dir;
  const Report r = cancelled_biases_run(dir, 3);
  CHECK(r.healthy());
  REQUIRE(alike_count(r, "underflow") == 1);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK(u.title == "c0.bias and 2 more layers: their gradients cancel to rounding, far below the other gradients of "
                   "their modules: not flushed by the scale");
  CHECK_THAT(u.evidence, Catch::EndsWith("; the same holds for c1.bias, c2.bias"));
}

TEST_CASE("two biases that cancel to rounding stay two findings", "[rules]") {
  TempDir dir;
  CHECK(alike_count(cancelled_biases_run(dir, 2), "underflow") == 2);
}

TEST_CASE("three or more gradients of exact zeros no scale makes are one information finding", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"l1.weight", "l2.weight", "l3.weight", "head.weight"});
  for (const char* layer : {"l1.weight", "l2.weight", "l3.weight"}) f.zeros_fraction(layer, 0.75, 0.09);
  for (int i = 0; i < 10; ++i) f.step(65536, 65536, 1000);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  REQUIRE(alike_count(r, "underflow") == 1);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK(u.title == "l1.weight and 2 more layers: their gradients are mostly exact zeros that the loss scale does not "
                   "make");
}
