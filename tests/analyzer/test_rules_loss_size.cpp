// overflow-origin where a loss's size says nothing of its gradients (one that goes below 0),
// and where torch's own Linear makes Inf at a scale of 1: its true gradients passed the range.
#include "rule_test.h"

TEST_CASE("a loss that goes below 0 is told to shrink, its size not taken for its gradients'", "[rules]") {
  // PyTorch's Poisson NLL, which leaves out Stirling's term, on counts around 2000: around 100
  // while the scale came down, -5000 once trained, and gradients of 2312 unscaled.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("head", false, 10.0).step(scale, scale / 2, 1000, {"head.weight"}, 100.0);
  for (int i = 0; i < 20; ++i) f.activation("head", false, 10.0).step(scale, scale, 37000, {}, -5000.0);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.evidence, !Catch::Contains("whose gradients are of the order of it"));
  REQUIRE(!o.suggestions.empty());
  const Suggestion& shrink = o.suggestions.front();
  CHECK_THAT(shrink.summary, Catch::StartsWith("Shrink the loss where it is made (it goes below 0, down to -5000: it "
                                               "leaves out a constant, so its size does not show how large its "
                                               "gradients are, up to 2312.5 unscaled): scale the regression targets "
                                               "down"));
  CHECK_THAT(shrink.python, Catch::StartsWith("y = y / y_scale"));
}

namespace {

// head's gradients go NaN/Inf first at every scale from 65536 down to 1/128, the gradient
// reaching its output finite at step 1; head a module of `type` defined at `source`.
Report own_backward_down_to_below_1(const TempDir& dir, const std::string& type, const std::string& source) {
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  f.module_type("head", type).module_source("head", source);
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2) {
    if (i == 1) f.event("module-output-gradient", "head: finite");
    f.activation("enc", false).activation("head", false).step(scale, scale / 2, 1000, {"head.weight"}, 100.0);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("torch's Linear making Inf from a finite gradient at a scale of 1 has true gradients beyond the range",
          "[rules]") {
  // A Poisson regression diverging on counts around 2000: nothing in a Linear's backward
  // makes NaN from finite values, so no sqrt of 0 is to look for.
  TempDir dir;
  const Report r = own_backward_down_to_below_1(dir, "Linear", "/venv/torch/nn/modules/linear.py:50");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::Contains("head's gradients exceed fp16's range even unscaled: they went NaN/Inf first "
                                      "down to a loss scale of"));
  CHECK_THAT(o.evidence, Catch::Contains("head is torch's Linear, whose backward only multiplies and adds"));
  REQUIRE(!o.suggestions.empty());
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Run head in FP32"));
  for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("Look first at the backward"));
}

TEST_CASE("a module of the user's own making Inf from a finite gradient at a scale of 1 gets its backward looked at",
          "[rules]") {
  TempDir dir;
  const Report r = own_backward_down_to_below_1(dir, "Linear", "/home/me/model.py:10");
  const Finding& o = required(r, "overflow-origin");
  CHECK_THAT(o.title, Catch::Contains("goes NaN/Inf first in backward at every loss scale"));
  REQUIRE(!o.suggestions.empty());
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Look first at the backward of head"));
}

namespace {

// head's gradients go NaN/Inf first 12 times from 65536, then fit at 16 (700 unscaled), under
// a loss of 54; head's outputs reach `outputs`; the loss code read before the first backward
// `first_code`, where given.
Report weighted_loss_run(const TempDir& dir, double outputs, const std::string& first_code = "") {
  RunFixture f(dir.file("run.db"), {"enc.weight", "head.weight"});
  if (!first_code.empty()) f.event("loss-code-first", first_code);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("head", false, outputs).step(scale, scale / 2, 1000, {"head.weight"}, 54.0);
  for (int i = 0; i < 20; ++i) f.activation("head", false, outputs).step(scale, scale, 11200, {}, 54.0);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("outputs of about 1 beside a loss of 54 are not called large", "[rules]") {
  // A detector's class logits and sigmoid boxes under its loss terms summed over three decoder
  // layers: the root of the loss, 7.4, says nothing of outputs this small.
  TempDir dir;
  const Report r = weighted_loss_run(dir, 1.09);
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(!o.suggestions.empty());
  CHECK_THAT(o.suggestions.front().summary, Catch::StartsWith("Shrink the loss where it is made") &&
                                                !Catch::Contains("outputs are large too"));
}

TEST_CASE("outputs of 20 beside a loss of 54 are called large", "[rules]") {
  TempDir dir;
  const Report r = weighted_loss_run(dir, 20.0);
  CHECK_THAT(required(r, "overflow-origin").suggestions.front().summary,
             Catch::Contains("the model's outputs are large too (head's, the last module's, reach 20)"));
}

TEST_CASE("a loss too large whose first loss code multiplies it by 16 is told to take the factor out", "[rules]") {
  // Nothing went NaN/Inf in the loss, so the loss code was read only before the first backward.
  TempDir dir;
  const Report r = weighted_loss_run(dir, 1.09, "ToCopy:float32, LogSoftmax:float32, NllLoss(mean of 160):float32, "
                                                "Mul(16):float32");
  const Finding& o = required(r, "overflow-origin");
  REQUIRE(o.suggestions.size() >= 2);
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Take out the loss code's multiplication by 16 (Mul, float32)"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains(": its targets are class indices, which no normalisation "
                                                       "shrinks"));
}
