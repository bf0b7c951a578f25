// underflow: a bias whose gradient sits far below its weight's, under a torch Linear taking
// inputs of RMS 1, cancels to rounding (DETR's attention key biases); the same ratio under a
// module of unknown arithmetic, or a ratio a true gradient gives, stays an underflow.
#include "rule_test.h"

namespace {

// key.bias's gradient at `ratio` of key.weight's per element (95 % of it fp16-subnormal), and
// key, of type `type`, making outputs of per-element RMS 0.16 from weights of RMS 0.02 and
// fan-in 64: an input of RMS 1.
Report unit_input_bias_run(const TempDir& dir, double ratio, const std::string& type) {
  RunFixture f(dir.file("run.db"), {"key.weight", "key.bias", "query.weight"});
  f.zeros_fraction("key.bias", 0.0, 0.95);
  f.module_type("key", type).module_source("key", type == "Linear" ? "/torch/nn/modules/linear.py:50" : "model.py:10");
  for (int i = 0; i < 10; ++i) {
    f.weight_norm("key.weight", 0.02 * 64);
    f.activation("key", false, 1.0, 0.16 * 64);
    f.clipped(0.32 * 47.0 * ratio, {"key.bias"}).step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a Linear's bias at 1/200 of its weight's gradient on inputs of RMS 1 cancels", "[rules]") {
  TempDir dir;
  const Report r = unit_input_bias_run(dir, 1.0 / 200.0, "Linear");
  CHECK(r.healthy());
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.title, Catch::StartsWith("key.bias's gradient cancels to rounding, far below key.weight's"));
  CHECK_THAT(u.evidence, Catch::Contains("(whose module's input is about 1 per element, estimated from its outputs "
                                         "and weights: a true gradient would be about 1 times the weight's)"));
}

TEST_CASE("the same bias under a module of the model's own stays an underflow", "[rules]") {
  // Its output need not be W x + b: the estimate of its input says nothing.
  TempDir dir;
  const Report r = unit_input_bias_run(dir, 1.0 / 200.0, "KeyProjection");
  CHECK(required(r, "underflow").severity == Severity::kWarning);
}

TEST_CASE("a Linear's bias at 1/20 of its weight's gradient on inputs of RMS 1 stays an underflow", "[rules]") {
  TempDir dir;
  const Report r = unit_input_bias_run(dir, 1.0 / 20.0, "Linear");
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kWarning);
  CHECK_THAT(u.title, !Catch::Contains("cancels to rounding"));
}
