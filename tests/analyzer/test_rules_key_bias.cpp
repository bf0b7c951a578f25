// underflow: a bias whose gradient sits far below its weight's cancels to rounding, not flushed
// by the scale: an attention key's bias under softmax (BERT's), beside a weight whose gradient
// is mostly exact zeros, on small inputs, under a torch Linear taking inputs of RMS 1 (DETR's
// key biases), or as its twin in another block does; the same ratio under a module of unknown
// arithmetic, or a ratio a true gradient gives, stays an underflow.
#include "rule_test.h"

namespace {

// key.bias's gradient at `ratio` of key.weight's per element (95 % of it fp16-subnormal), and
// key making outputs of per-element RMS `output_rms` from weights of RMS 0.02 and fan-in 64:
// an input of RMS output_rms / (8 * 0.02), 1 for 0.16. No output rows where it is 0. Of type
// `type` (torch's Linear, or the model's own) where given, else of none.
Report bias_run(const TempDir& dir, double ratio, double output_rms, const std::string& type = "") {
  RunFixture f(dir.file("run.db"), {"key.weight", "key.bias", "query.weight"});
  f.zeros_fraction("key.bias", 0.0, 0.95);
  if (!type.empty())
    f.module_type("key", type).module_source("key", type == "Linear" ? "/torch/nn/modules/linear.py:50" : "model.py:10");
  for (int i = 0; i < 10; ++i) {
    f.weight_norm("key.weight", 0.02 * 64);
    if (output_rms > 0.0) f.activation("key", false, 1.0, output_rms * 64);
    f.clipped(0.32 * 47.0 * ratio, {"key.bias"}).step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a Linear's bias at 1/200 of its weight's gradient on inputs of RMS 1 cancels", "[rules]") {
  TempDir dir;
  const Report r = bias_run(dir, 1.0 / 200.0, 0.16, "Linear");
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
  const Report r = bias_run(dir, 1.0 / 200.0, 0.16, "KeyProjection");
  CHECK(required(r, "underflow").severity == Severity::kWarning);
}

TEST_CASE("a Linear's bias at 1/20 of its weight's gradient on inputs of RMS 1 stays an underflow", "[rules]") {
  TempDir dir;
  const Report r = bias_run(dir, 1.0 / 20.0, 0.16, "Linear");
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kWarning);
  CHECK_THAT(u.title, !Catch::Contains("cancels to rounding"));
}

namespace {

// An attention key's bias whose gradient has the L2 norm `bias_l2` at every step (95 % of it
// fp16-subnormal, `zeros` exact zeros) beside key.weight's and query.weight's (10 to 20).
Report key_bias_run(const TempDir& dir, double bias_l2, double zeros) {
  RunFixture f(dir.file("run.db"), {"key.weight", "key.bias", "query.weight"});
  f.zeros_fraction("key.bias", zeros, 0.95);
  for (int i = 0; i < 10; ++i) f.clipped(bias_l2, {"key.bias"}).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a bias whose gradient is rounding far below its weight's at the same scale is info, not underflow",
          "[rules]") {
  // BERT's attention key bias: it shifts every score of a query alike, so softmax cancels its
  // gradient to rounding, 1e-4 of the key weight's per element, fp16-subnormal at 65536.
  TempDir dir;
  const auto r = key_bias_run(dir, 1e-4, 0.0);
  CHECK(r.healthy());
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kInfo);
  CHECK_THAT(u->title, Catch::StartsWith("key.bias's gradient cancels to rounding, far below key.weight's"));
  CHECK(u->suggestions.empty());
}

TEST_CASE("a key bias beside a weight whose gradient is mostly exact zeros still cancels to rounding", "[rules]") {
  // BERT's query and key weights 3000 times too large: the softmax saturates to 0 and 1, so
  // key.weight's gradient is mostly exact zeros (a structural population, not a flush), and
  // key.bias's other values are the rounding its softmax leaves.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"key.weight", "key.bias", "query.weight"});
  f.zeros_fraction("key.weight", 0.95, 0.005).zeros_fraction("key.bias", 0.79, 0.21);
  for (int i = 0; i < 10; ++i) f.clipped(1e-4, {"key.bias"}).step(65536, 65536);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.title, Catch::StartsWith("key.bias's gradient cancels to rounding, far below key.weight's"));
}

TEST_CASE("a bias at 1/47 of its weight's gradient whose module takes inputs of RMS 0.02 is rounding too", "[rules]") {
  // DeBERTa's position keys' bias: their relative-position embeddings, without their norm,
  // are of RMS 0.02, where a true bias gradient is ~50 times the weight's and rounding ~1/47.
  TempDir dir;
  const Report r = bias_run(dir, 1.0 / 47.0, 0.0032);
  CHECK(r.healthy());
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kInfo);
  CHECK_THAT(u.title, Catch::StartsWith("key.bias's gradient cancels to rounding, far below key.weight's"));
  CHECK_THAT(u.evidence, Catch::Contains("(whose module's input is small, about 0.02 per element, estimated from its "
                                         "outputs and weights: a true gradient would be about 50 times the weight's)"));
}

TEST_CASE("the same bias whose module takes inputs of RMS 0.5 stays an underflow", "[rules]") {
  TempDir dir;
  const Report r = bias_run(dir, 1.0 / 47.0, 0.08);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kWarning);
  CHECK_THAT(u.title, !Catch::Contains("cancels to rounding"));
}

TEST_CASE("the same bias without its module's outputs stays an underflow", "[rules]") {
  TempDir dir;
  const Report r = bias_run(dir, 1.0 / 47.0, 0.0);
  const Finding& u = required(r, "underflow");
  CHECK(u.severity == Severity::kWarning);
}

TEST_CASE("a bias at 1/725 of its weight's gradient, ELECTRA's first key bias after an unnormalised projection, is "
          "rounding too",
          "[rules]") {
  TempDir dir;
  const auto r = key_bias_run(dir, 0.02, 0.03);
  CHECK(r.healthy());
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kInfo);
}

TEST_CASE("a bias at 1/300 of its weight's gradient, as inputs of RMS 300 leave it, is an underflow", "[rules]") {
  TempDir dir;
  const auto r = key_bias_run(dir, 0.05, 0.03);
  const Finding* u = find(r, "underflow");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kWarning);
}

namespace {

// Two blocks of the same structure: layers.0's key bias at `first_l2` and layers.1's at
// `second_l2` every step (95 % of each fp16-subnormal), beside their key weights'; layers.0's
// key weight 62 % fp16-subnormal where `first_weight_underflows` (DETR's first encoder block
// at a scale its decoder holds at 256).
Report two_block_key_bias_run(const TempDir& dir, double first_l2, double second_l2,
                              bool first_weight_underflows = false) {
  RunFixture f(dir.file("run.db"), {"layers.0.key.weight", "layers.0.key.bias", "layers.1.key.weight",
                                    "layers.1.key.bias"});
  f.zeros_fraction("layers.0.key.bias", 0.0, 0.95).zeros_fraction("layers.1.key.bias", 0.0, 0.95);
  if (first_weight_underflows) f.zeros_fraction("layers.0.key.weight", 0.005, 0.62);
  for (int i = 0; i < 10; ++i)
    f.clipped(first_l2, {"layers.0.key.bias"}).clipped(second_l2, {"layers.1.key.bias"}).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a bias at 1/300 of its weight's gradient whose twin in another block cancels to rounding cancels too",
          "[rules]") {
  // Marian's first decoder block's key bias keeps more rounding (1/370 of its weight's) than
  // the second block's (1/1090): the same sum, zero in exact arithmetic in both.
  TempDir dir;
  const Report r = two_block_key_bias_run(dir, 0.05, 1e-4);
  CHECK(r.healthy());
  const Finding* u = find(r, "underflow", "layers.0.key.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kInfo);
  CHECK_THAT(u->title, Catch::StartsWith("layers.0.key.bias's gradient cancels to rounding"));
  CHECK_THAT(u->evidence, Catch::Contains("; layers.1.key.bias, the same parameter in another block of the same "
                                          "structure, sits at"));
}

TEST_CASE("a bias at 1/300 of its weight's gradient whose twin is at 1/300 as well stays an underflow", "[rules]") {
  TempDir dir;
  const Report r = two_block_key_bias_run(dir, 0.05, 0.05);
  const Finding* u = find(r, "underflow", "layers.0.key.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kWarning);
}

TEST_CASE("a bias near its weight's gradient stays an underflow beside a twin that cancels to rounding", "[rules]") {
  // A true underflow sits at ~1 / |x| of its weight's: no twin's cancelling makes it rounding.
  TempDir dir;
  const Report r = two_block_key_bias_run(dir, 0.5, 1e-4);
  const Finding* u = find(r, "underflow", "layers.0.key.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kWarning);
}

TEST_CASE("a bias far below a weight that underflows too cancels where its twin in another block does", "[rules]") {
  TempDir dir;
  const Report r = two_block_key_bias_run(dir, 1e-4, 1e-4, true);
  const Finding* u = find(r, "underflow", "layers.0.key.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kInfo);
  CHECK_THAT(u->evidence, Catch::Contains("whose own gradient underflows too, yet far above this one's"));
  CHECK_THAT(u->evidence, Catch::Contains("layers.1.key.bias, the same parameter in another block"));
}

TEST_CASE("a bias at 1/30 of a weight that underflows too stays an underflow beside a twin that cancels",
          "[rules]") {
  TempDir dir;
  const Report r = two_block_key_bias_run(dir, 0.5, 1e-4, true);
  const Finding* u = find(r, "underflow", "layers.0.key.bias");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kWarning);
}

TEST_CASE("a small bias beside a weight that underflows too is an underflow", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"key.weight", "key.bias"});
  f.zeros_fraction("key.bias", 0.0, 0.95).zeros_fraction("key.weight", 0.6, 0.2);
  for (int i = 0; i < 10; ++i) f.clipped(1e-4, {"key.bias"}).step(65536, 65536);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  for (const auto& finding : r.findings)
    if (finding.rule == "underflow") CHECK(finding.severity == Severity::kWarning);
  REQUIRE(find(r, "underflow") != nullptr);
}
