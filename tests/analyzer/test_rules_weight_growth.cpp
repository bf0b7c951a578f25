// weight-growth: the weights of the module that overflowed grew many times over in the steps
// before (a learning rate far too high), so the overflow findings point to it.
#include <cmath>

#include "rule_test.h"

namespace {

// `calm` steps at weights of L2 `start` (4096 values a layer), then weights growing `factor` times over 8 steps, then
// `overflows` steps where mlp.down's output goes Inf (skipped, the weights as they were).
// `settings`: event optimizer-settings, none where empty.
Report grown(const TempDir& dir, double factor, int overflows = 6, int calm = 1, const std::string& settings = "",
              double start = 1.8) {
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  if (!settings.empty()) f.event("optimizer-settings", settings);
  double l2 = start;
  for (int i = 0; i < calm; ++i) f.weight_norms(l2).step(65536, 65536);
  for (int i = 1; i <= 8; ++i) f.weight_norms(l2 = start * std::pow(factor, i / 8.0)).step(65536, 65536);
  double scale = 65536;
  for (int i = 0; i < overflows; ++i, scale /= 2)
    f.weight_norms(l2).activation("mlp.down", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("weights grown many times over before their module overflowed are the finding", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 57.0);
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK(f->severity == Severity::kError);
  CHECK(f->module == "mlp.down");
  CHECK(f->title == "The weights grew 57x in 8 steps while the run overflowed: the optimizer's steps are far too large");
  CHECK_THAT(f->evidence, Catch::StartsWith("mlp.down's weights (L2 norm, all their parameters together) went from 1.8 "
                                            "at step 0 to 102.6 at step 8"));
  CHECK(r.findings.front().rule == "weight-growth");
}

namespace {

// DANN's gradient reversal at lambda 1e5 in miniature: `sender` (probed, holding no
// parameters) sends mlp.down NaN/Inf through its output (events module-output-gradient,
// module-gradient-sender) while the scale falls from 65536 to 0.5; there mlp.down's finite
// gradients reach 80000 unscaled, the steps go through and its weights grow 57x; then
// NaN/Inf again.
Report grown_through(const TempDir& dir, const std::string& sender) {
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  f.event("module-output-gradient", "mlp.down: nonfinite").event("module-gradient-sender", "mlp.down: " + sender);
  double scale = 65536;
  for (; scale >= 1; scale /= 2)
    f.activation("mlp.down", false).activation(sender, false).weight_norms(1.8)
        .step(scale, scale / 2, 1000, {"mlp.down.weight"});
  for (int i = 1; i <= 8; ++i)
    f.activation("mlp.down", false).activation(sender, false).weight_norms(1.8 * std::pow(57.0, i / 8.0))
        .step(scale, scale, 40000);
  for (int i = 0; i < 2; ++i, scale /= 2)
    f.activation("mlp.down", false).activation(sender, false).weight_norms(1.8 * 57.0)
        .step(scale, scale / 2, 1000, {"mlp.down.weight"});
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("weights grown on gradients a module without parameters enlarged point to its backward first",
          "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown_through(dir, "grl");
  const Finding& f = required(r, "weight-growth");
  CHECK_THAT(f.title, Catch::StartsWith("The weights grew 57x in 8 steps while the run overflowed") &&
                          Catch::EndsWith("the optimizer's steps are far too large, on gradients grl's backward enlarges"));
  CHECK_THAT(f.evidence, Catch::EndsWith("grl, given mlp.down's output, received a finite gradient at its own output and "
                                         "sent NaN/Inf back to it, and it holds no parameters: its code enlarges the "
                                         "gradients mlp.down and the layers before it step on"));
  REQUIRE(f.suggestions.size() == 2);
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("Look at grl's backward: it holds no parameters"));
  CHECK_THAT(f.suggestions[0].python, Catch::Contains("-ctx.lam * grad"));
  CHECK(f.suggestions[0].untried);
  CHECK_THAT(f.suggestions[1].summary, Catch::StartsWith("Lower the learning rate"));
}

TEST_CASE("weights grown on gradients a module with parameters sent keep the learning rate first", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown_through(dir, "head");  // head holds head.weight
  const Finding& f = required(r, "weight-growth");
  CHECK_THAT(f.title, Catch::EndsWith("the optimizer's steps are far too large"));
  CHECK_THAT(f.suggestions.front().summary, Catch::StartsWith("Lower the learning rate"));
}

TEST_CASE("weights that stood still through the first steps grew from where they first moved", "[rules][weight-growth]") {
  // As after a run's first steps were all skipped: they leave the weights as they were.
  TempDir dir;
  const Report r = grown(dir, 57.0, 6, 3);
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK(f->title == "The weights grew 57x in 8 steps while the run overflowed: the optimizer's steps are far too large");
  CHECK_THAT(f->evidence, Catch::StartsWith("mlp.down's weights (L2 norm, all their parameters together) went from 1.8 "
                                            "at step 2 to 102.6 at step 10"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->evidence, Catch::EndsWith("; mlp.down's weights grew 57x from step 2 to step 10"));
}

TEST_CASE("the overflow's own finding becomes a warning whose first fix points to the growth", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 57.0);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kWarning);
  CHECK_THAT(fw->suggestions.front().summary, Catch::StartsWith("The weights were growing (see weight-growth)"));
  CHECK(fw->suggestions.front().untried);
}

TEST_CASE("the fix lowers the learning rate the run recorded", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 57.0, 6, 1, "AdamW lr=0.3 weight_decay=0.01");
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->evidence, Catch::Contains("optimizer: AdamW lr=0.3 weight_decay=0.01"));
  CHECK(f->suggestions.front().python ==
        "optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)  # a tenth of lr=0.3; or warm it up");
}

TEST_CASE("the C++ fix lowers the learning rate of the LibTorch optimizer the run recorded", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 57.0, 6, 1, "SGD lr=0.5 weight_decay=0 momentum=0.9");
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK(f->suggestions.front().cpp ==
        "torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(/*lr=*/0.05));  // a tenth of lr=0.5; "
        "or warm it up");
}

TEST_CASE("an optimizer from outside torch keeps its own name in the fix", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 57.0, 6, 1, "Lion lr=0.001 weight_decay=0.1");
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK(f->suggestions.front().python == "optimizer = Lion(model.parameters(), lr=0.0001)  # a tenth of lr=0.001; or warm it up");
  CHECK_THAT(f->suggestions.front().cpp, Catch::StartsWith("// the optimizer's learning rate well below"));
}

namespace {

// As grown(dir, 57.0), the optimizer's settings recorded as a warm-up from 0 has them: lr=0
// before step 0, "lr=0.3" before step 4 (the growth ends at step 8), "lr=0.03" before step
// 12 (a decay, after the growth); only the first where `warm_up_only`.
Report grown_under_schedule(const TempDir& dir, bool warm_up_only = false) {
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  f.event("optimizer-settings", "AdamW lr=0 weight_decay=0.01");
  double l2 = 1.8;
  f.weight_norms(l2).step(65536, 65536);
  for (int i = 1; i <= 8; ++i) {
    if (i == 4 && !warm_up_only) f.event("optimizer-settings", "AdamW lr=0.3 weight_decay=0.01");
    f.weight_norms(l2 = 1.8 * std::pow(57.0, i / 8.0)).step(65536, 65536);
  }
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2) {
    if (i == 3 && !warm_up_only) f.event("optimizer-settings", "AdamW lr=0.03 weight_decay=0.01");
    f.weight_norms(l2).activation("mlp.down", true).step(scale, scale / 2, 1000, {}, kNaN);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("under a schedule the fix lowers the rate the weights grew under, not the warm-up's first",
          "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown_under_schedule(dir);
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->evidence,
             Catch::Contains("optimizer: AdamW lr=0.3 weight_decay=0.01 at step 4 (lr=0 at step 0: a schedule moved it)"));
  CHECK(f->suggestions.front().python ==
        "optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)  # a tenth of lr=0.3, the rate at step 4: lower "
        "the schedule's peak as much");
}

TEST_CASE("a learning rate of 0 recorded at a warm-up's first step is not offered as a tenth of itself",
          "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown_under_schedule(dir, true);
  const Finding* f = find(r, "weight-growth");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->suggestions.front().python, Catch::Contains("lr=...)  # well below the present lr"));
}

namespace {

// The weights at L2 1.8 (RMS 0.028), 1.9x larger after the first optimizer step, the loss
// 1.7 before it and `loss_after` after; then 4 steps of slight growth and 6 steps where
// mlp.down's output goes Inf (skipped).
Report one_step_jump(const TempDir& dir, double loss_after) {
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  f.event("optimizer-settings", "AdamW lr=0.1 weight_decay=0.01");
  f.weight_norms(1.8).step(65536, 65536, 1000, {}, 1.7);
  double l2 = 1.8 * 1.9;
  f.weight_norms(l2).step(65536, 65536, 1000, {}, loss_after);
  for (int i = 0; i < 4; ++i) f.weight_norms(l2 *= 1.05).step(65536, 65536, 1000, {}, loss_after);
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.weight_norms(l2).activation("mlp.down", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("weights that grew 1.9x in one step as the loss rose 60x are a learning rate far too high",
          "[rules][weight-growth]") {
  // AdamW at 0.1 on a small transformer: every weight moves by ~0.1 on weights of RMS 0.06.
  TempDir dir;
  const Report r = one_step_jump(dir, 104.0);
  const Finding& g = required(r, "weight-growth");
  CHECK(g.severity == Severity::kError);
  CHECK(g.title == "The weights grew 1.9x in one step (step 0) while the run overflowed: the optimizer's steps are far "
                   "too large");
  CHECK_THAT(g.evidence, Catch::Contains("1.9x in one step (step 0), the loss 1.7 at step 0 and 104 at step 1: a step of "
                                         "about their own size"));
  CHECK_THAT(g.suggestions.front().python, Catch::Contains("lr=0.01"));
}

TEST_CASE("weights that grew 1.9x in one step as the loss fell are learning, not a learning rate too high",
          "[rules][weight-growth]") {
  // A regression whose loss falls from 16 to 3.6 in its first SGD step.
  TempDir dir;
  const Report r = one_step_jump(dir, 0.4);
  CHECK(find(r, "weight-growth") == nullptr);
}

TEST_CASE("weights that grew 1.9x in one step after which the loss was NaN are the gradients', not the rate's",
          "[rules][weight-growth]") {
  // The one step a similarity times 98716 let through at a low scale, the loss NaN from then.
  TempDir dir;
  const Report r = one_step_jump(dir, kNaN);
  CHECK(find(r, "weight-growth") == nullptr);
}

namespace {

// mlp.down's output goes Inf from step 2 on, its weights still; stem's weights grow 11x in the
// one optimizer step at step 0, the loss 10 before it and `loss_after` after.
Report stem_jump(const TempDir& dir, double loss_after) {
  RunFixture f(dir.file("run.db"), {"stem.weight", "mlp.down.weight"});
  f.event("optimizer-settings", "SGD lr=0.01 weight_decay=0.0001 momentum=0.9");
  f.weight_norm("stem.weight", 1.8).weight_norm("mlp.down.weight", 1.8).step(65536, 65536, 1000, {}, 10.0);
  f.weight_norm("stem.weight", 19.8).weight_norm("mlp.down.weight", 1.8).step(65536, 65536, 1000, {}, loss_after);
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.weight_norm("stem.weight", 19.8).weight_norm("mlp.down.weight", 1.8).activation("mlp.down", true).step(
        scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("another module's weights that grew 11x in one step as the loss doubled are the growth", "[rules][weight-growth]") {
  // A Mask R-CNN from scratch at SGD 0.01: its stem convolution grew 11x in one step, while
  // the first to overflow was an FPN block whose weights barely moved.
  TempDir dir;
  const Report r = stem_jump(dir, 21.0);
  const Finding& g = required(r, "weight-growth");
  CHECK(g.module == "stem");
  CHECK(g.title == "The weights grew 11x in one step (step 0) while the run overflowed: the optimizer's steps are far "
                   "too large");
  CHECK_THAT(g.evidence, Catch::StartsWith("stem's weights (L2 norm, all their parameters together) went from 1.8 at "
                                           "step 0 to 19.8 at step 1"));
  const Finding& fw = required(r, "forward-nonfinite");
  CHECK_THAT(fw.evidence, Catch::EndsWith("stem's weights grew 11x from step 0 to step 1"));
}

TEST_CASE("another module's weights that grew 11x in one step as the loss fell are no growth finding",
          "[rules][weight-growth]") {
  TempDir dir;
  const Report r = stem_jump(dir, 4.0);
  CHECK(find(r, "weight-growth") == nullptr);
}

TEST_CASE("weights that grew a little before an overflow leave the overflow its own finding", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 2.0);
  CHECK(find(r, "weight-growth") == nullptr);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK(fw->severity == Severity::kError);
}

TEST_CASE("growth long before the overflows is not taken as their cause", "[rules][weight-growth]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "head.weight"});
  for (int i = 0; i < 8; ++i) f.weight_norms(1.8 * std::pow(57.0, i / 7.0)).step(65536, 65536);
  for (int i = 8; i < 400; ++i) f.weight_norms(102.6).step(65536, 65536);
  f.weight_norms(102.6).activation("mlp.down", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(find(r, "weight-growth") == nullptr);
}

TEST_CASE("weights that grew while the scaler calibrated and then trained clear of NaN/Inf are information",
          "[rules][weight-growth]") {
  // An ArcFace head, F.normalize(W) from 0.01 * randn under SGD at 0.1: W's gradient is 1 / |W|
  // times larger, so W grows 29x in two steps, the scale comes down from 65536 to 4096 in four
  // skips during its descent, and the run then trains, its loss falling.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight", "body.weight"});
  double scale = 65536, l2 = 0.8;
  for (int i = 0; i < 2; ++i, scale /= 2) f.weight_norms(l2).step(scale, scale / 2, 1000, {"head.weight"}, 43.0);
  for (int i = 0; i < 2; ++i) f.weight_norms(l2 *= 5.4).step(scale, scale, 1000, {}, 30.0);
  for (int i = 0; i < 2; ++i, scale /= 2) f.weight_norms(l2).step(scale, scale / 2, 1000, {"head.weight"}, 30.0);
  for (int i = 0; i < 20; ++i) f.weight_norms(l2).step(scale, scale, 1000, {}, 5.0);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  const Finding& g = required(r, "weight-growth");
  CHECK(g.severity == Severity::kInfo);
  CHECK(g.title == "The weights grew 29x in 2 steps while the scaler calibrated; the loss scale copes with it");
  CHECK(g.suggestions.empty());
  for (const auto& o : r.findings)
    for (const auto& s : o.suggestions) CHECK_THAT(s.summary, !Catch::Contains("see weight-growth"));
}

TEST_CASE("weights that grew while the scale descended below the floor stay the error", "[rules][weight-growth]") {
  // AdamW at 0.3: the weights grow 14x while every other step skips, from 65536 down to 64,
  // and the run then trains at that scale: each skip was the descent's, but it collapsed.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight", "body.weight"});
  double scale = 65536, l2 = 1.8;
  for (int i = 0; i < 10; ++i, scale /= 2) {
    f.weight_norms(l2).step(scale, scale / 2, 1000, {"head.weight"}, 3.0);
    f.weight_norms(l2 *= 1.3).step(scale / 2, scale / 2, 1000, {}, 3.0);
  }
  for (int i = 0; i < 20; ++i) f.weight_norms(l2).step(scale, scale, 1000, {}, 2.3);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  CHECK(required(r, "weight-growth").severity == Severity::kError);
}

TEST_CASE("weights that jumped as the loss rose a hundredfold are the error though the scale stopped at the floor",
          "[rules][weight-growth]") {
  // A LibTorch MLP at AdamW lr=0.3: 8.3x in one step as a cross-entropy of 2.3 became 299,
  // then nine halvings from 65536 that stopped at the floor of 128 and a loss that never came
  // back; read as calibration only, it had been called healthy.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"head.weight", "body.weight"});
  f.event("optimizer-settings", "AdamW lr=0.3 weight_decay=0.01");
  f.weight_norms(1.8).step(65536, 65536, 1000, {}, 2.3);
  double scale = 65536, l2 = 1.8 * 8.3;
  for (int i = 0; i < 9; ++i, scale /= 2) f.weight_norms(l2).step(scale, scale / 2, 1000, {"head.weight"}, 299.0);
  for (int i = 0; i < 20; ++i) f.weight_norms(l2).step(scale, scale, 1000, {}, 40.0);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& g = required(r, "weight-growth");
  CHECK(g.severity == Severity::kError);
  CHECK_THAT(g.evidence, Catch::Contains("the loss 2.3 at step 0 and 299 at step 1"));
  CHECK_THAT(g.suggestions.front().python, Catch::Contains("lr=0.03"));
}

TEST_CASE("grown weights in a run that never overflowed are no finding", "[rules][weight-growth]") {
  TempDir dir;
  const Report r = grown(dir, 57.0, 0);
  CHECK(find(r, "weight-growth") == nullptr);
  CHECK(r.healthy());
}

TEST_CASE("weights that start near zero and grow many times over are not taken for a learning rate", "[rules][weight-growth]") {
  // A layer scale starting at 1e-5 (root mean square) is meant to grow by orders of magnitude.
  TempDir dir;
  const Report r = grown(dir, 100.0, 6, 1, "", 1e-5 * 64);
  CHECK(find(r, "weight-growth") == nullptr);
}

TEST_CASE("an overflow finding on a module whose weights were not sampled does not hide the growth",
          "[rules][weight-growth]") {
  // A GPT-2 at lr 5e-2: an early backward skip names lm_head, whose weight is the tied
  // embedding's (event tied-gradient-nonfinite), so no weights of its own were sampled; the
  // attention's grew 12x before it overflowed in forward. It used to read no growth at all.
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"mlp.down.weight", "emb.weight"});
  double l2 = 1.8;
  f.weight_norms(l2).event("tied-gradient-nonfinite", "emb.weight through lm").step(65536, 32768, 1000, {"emb.weight"});
  for (int i = 1; i <= 8; ++i) f.weight_norms(l2 = 1.8 * std::pow(57.0, i / 8.0)).step(32768, 32768);
  double scale = 32768;
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.weight_norms(l2).activation("mlp.down", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  REQUIRE(find(r, "overflow-origin") != nullptr);
  CHECK(find(r, "overflow-origin")->module == "lm");
  const Finding* g = find(r, "weight-growth");
  REQUIRE(g != nullptr);
  CHECK(g->module == "mlp.down");
}
