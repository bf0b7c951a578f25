// gradients-not-zeroed: the Python agent found the previous step's gradient still in place
// as a step's first arrived. The overflows that the growing sum makes point to it
// (tests/scenarios/test_stale_gradients.py runs the real loop, and the fixed one).
#include "rule_test.h"

namespace {

const char* kUnzeroed = "head.weight's gradient still held the previous optimizer step's values when this step's first "
                      "gradient arrived: the gradients were not zeroed between steps";

}  // namespace

TEST_CASE("gradients not zeroed are the first error, and the overflows they grow into point to them",
          "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 65536);
  f.event("gradients-not-zeroed", kUnzeroed).step(65536, 65536);
  double scale = 65536;
  for (int i = 0; i < 16; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE_FALSE(r.findings.empty());
  const Finding& first = r.findings.front();
  CHECK(first.rule == "gradients-not-zeroed");
  CHECK(first.severity == Severity::kError);
  CHECK_THAT(first.evidence, Catch::StartsWith("from step 1, head.weight's gradient still held"));
  CHECK_THAT(first.suggestions.front().python, Catch::StartsWith("optimizer.zero_grad()  # once per optimizer step"));
  const Finding* origin = find(r, "overflow-origin");
  REQUIRE(origin != nullptr);
  CHECK(origin->severity == Severity::kWarning);
  REQUIRE(origin->suggestions.size() == 1);
  CHECK_THAT(origin->suggestions.front().summary, Catch::Contains("see gradients-not-zeroed"));
  const Finding* collapse = find(r, "scale-collapse");
  REQUIRE(collapse != nullptr);
  CHECK_THAT(collapse->suggestions.front().summary, Catch::Contains("see gradients-not-zeroed"));
}

TEST_CASE("an overflow before the gradients stopped being zeroed keeps its own verdict", "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  double scale = 65536;
  for (int i = 0; i < 14; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"});
  f.event("gradients-not-zeroed", kUnzeroed).step(scale, scale);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* origin = find(r, "overflow-origin");
  REQUIRE(origin != nullptr);
  CHECK(origin->severity == Severity::kError);
  CHECK_THAT(origin->suggestions.front().summary, !Catch::Contains("gradients-not-zeroed"));
}

TEST_CASE("without a scaler the fix zeroes around optimizer.step()", "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("amp_dtype", "bfloat16").meta("scaler_enabled", "0");
  f.step(1, 1).event("gradients-not-zeroed", kUnzeroed).step(1, 1);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* z = find(r, "gradients-not-zeroed");
  REQUIRE(z != nullptr);
  CHECK_THAT(z->suggestions.front().python, Catch::Contains("loss.backward()\noptimizer.step()"));
}

TEST_CASE("an overflow whose first skip was the first step's, before the event, still points to it",
          "[rules][zero-grad]") {
  // The scale calibrating at step 0; the unzeroed gradients overflow from step 1 on.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.step(65536, 32768, 1000, {"head.weight"});
  f.event("gradients-not-zeroed", kUnzeroed);
  double scale = 32768;
  for (int i = 0; i < 16; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"});
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.findings.front().rule == "gradients-not-zeroed");
  const Finding* origin = find(r, "overflow-origin");
  REQUIRE(origin != nullptr);
  CHECK(origin->severity == Severity::kWarning);
}

TEST_CASE("every gradient exactly zero where the optimizer stepped is an error: cleared before the step",
          "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 8; ++i) f.step(65536, 65536, 0.0);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "gradients-cleared");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK_THAT(c->evidence, Catch::Contains("in 8 of 8 recorded steps, from step 0, each of the 4 gradients was all zeros"));
  CHECK_THAT(c->suggestions.front().python, Catch::StartsWith("optimizer.zero_grad()  # before the backward"));
}

TEST_CASE("all-zero gradients that arrived zero from backward are the loss's, not a cleared loop", "[rules][zero-grad]") {
  // A contrastive loss at a temperature so small that it is exactly 0 (Python agent's event).
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("gradients-arrived-zero", "head.bias's gradient arrived from backward all zeros");
  for (int i = 0; i < 8; ++i) f.step(65536, 65536, 0.0, {}, 0.0);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "gradients-cleared") == nullptr);
  const Finding* z = find(r, "zero-gradients");
  REQUIRE(z != nullptr);
  CHECK(z->severity == Severity::kError);
  CHECK(z->title == "Every gradient was exactly zero when the optimizer stepped: backward made them zero, and nothing "
                    "trains");
  CHECK_THAT(z->evidence, Catch::EndsWith("in step 0, head.bias's gradient arrived from backward all zeros, before "
                                          "anything could clear it: the loss's gradient is zero, and the loss was "
                                          "exactly 0 in every one of those steps"));
  CHECK_THAT(z->suggestions.front().summary, Catch::StartsWith("Look at the loss, not at zero_grad()"));
  CHECK(z->suggestions.front().python.empty());
}

namespace {

// A classifier whose last module's output turned all zeros from step `from` on (SqueezeNet's
// dead ReLU before its pooling), its gradients all zero in those steps, seen arriving zero
// from backward; `dead` false: its output stays nonzero (a loss that saturated).
Report dead_output(const TempDir& dir, bool dead, int from = 3) {
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 11; ++i) {
    if (i == from) f.event("gradients-arrived-zero", "head.bias's gradient arrived from backward all zeros");
    f.activation("features", false).activation("classifier.1", false).activation("classifier.3", false, 10.0, 100.0,
                                                                                  dead && i >= from);
    if (i < from)
      f.step(65536, 65536, 1000.0, {}, 2.2);
    else
      f.step(65536, 65536, 0.0, {}, 2.302585);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("all-zero gradients under a model output of all zeros name that output, not the loss", "[rules][zero-grad]") {
  TempDir dir;
  const Report r = dead_output(dir, true);
  const Finding& z = required(r, "zero-gradients");
  CHECK(z.severity == Severity::kError);
  CHECK(z.title == "Every gradient was exactly zero when the optimizer stepped: the model's output was all zeros, so "
                   "backward sent none back, and nothing trains");
  CHECK_THAT(z.evidence, Catch::Contains("before anything could clear it: backward made it zero; at step 10 "
                                         "classifier.3's output, the model's last, was all zeros (4096 of 4096 "
                                         "values), while classifier.1's, which finished just before it, was not"));
  CHECK_THAT(z.suggestions.front().summary, Catch::StartsWith("Find what zeroes the model's output") &&
                                                Catch::Contains("a dead ReLU"));
}

TEST_CASE("a model output of all zeros from the first step is the initialisation's, not a step's", "[rules][zero-grad]") {
  // DPT's depth head ends in a ReLU after a convolution at std 0.02 and a bias of 0: dead
  // before any optimizer step, which no learning rate explains.
  TempDir dir;
  const Report r = dead_output(dir, true, 0);
  const Finding& z = required(r, "zero-gradients");
  CHECK_THAT(z.suggestions.front().summary, Catch::Contains("It was all zeros from the first step, before any optimizer "
                                                            "step, so what the model started with made it") &&
                                                !Catch::Contains("Lower the learning rate"));
}

TEST_CASE("all-zero gradients under a model output that is not zero keep the look at the loss", "[rules][zero-grad]") {
  TempDir dir;
  const Report r = dead_output(dir, false);
  const Finding& z = required(r, "zero-gradients");
  CHECK_THAT(z.title, Catch::Contains("backward made them zero"));
  CHECK_THAT(z.suggestions.front().summary, Catch::StartsWith("Look at the loss, not at zero_grad()"));
}

namespace {

// `trained` steps with gradients and a loss of 0.4, then 10 whose gradients were all zero
// with a loss of `then`, seen arriving zero from backward at the first of them (`seen`).
Report trained_then_zero(const TempDir& dir, int trained, double then, bool seen = true) {
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < trained; ++i) f.step(65536, 65536, 1000.0, {}, 0.4);
  if (seen) f.event("gradients-arrived-zero", "head.bias's gradient arrived from backward all zeros");
  for (int i = 0; i < 10; ++i) f.step(65536, 65536, 0.0, {}, then);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a loss that reached exactly 0 after steps that trained is information, not an error", "[rules][zero-grad]") {
  // A triplet loss once every triplet meets its margin: the model learnt, then nothing is left.
  TempDir dir;
  const Report r = trained_then_zero(dir, 6, 0.0);
  const Finding& z = required(r, "zero-gradients");
  CHECK(z.severity == Severity::kInfo);
  CHECK(z.title == "The loss reached exactly 0 at step 6, after 6 steps that trained, and was 0 in 10 steps: those "
                   "steps train nothing, and nothing overflowed or underflowed");
  CHECK_THAT(z.suggestions.front().summary, Catch::StartsWith("No precision problem"));
  CHECK_FALSE(Gate("error").fails(r));
}

TEST_CASE("a loss that reached exactly 0 with no gradient seen arriving zero is not a cleared loop", "[rules][zero-grad]") {
  // The agent looks at arrivals every 16th step (the C++ agent not at all): the zero loss
  // alone says the gradients are the loss's, since a loop that clears them still has a loss.
  TempDir dir;
  const Report r = trained_then_zero(dir, 6, 0.0, false);
  CHECK(find(r, "gradients-cleared") == nullptr);
  const Finding& z = required(r, "zero-gradients");
  CHECK(z.severity == Severity::kInfo);
  CHECK_THAT(z.evidence, Catch::EndsWith("where scaler.step() unscaled them; the loss was exactly 0 in every one of "
                                         "those steps"));
}

TEST_CASE("gradients all zero from the start under a loss exactly 0 are the loss's, not a cleared loop",
          "[rules][zero-grad]") {
  TempDir dir;
  const Report r = trained_then_zero(dir, 0, 0.0, false);
  CHECK(find(r, "gradients-cleared") == nullptr);
  CHECK(required(r, "zero-gradients").severity == Severity::kError);
}

TEST_CASE("a loss exactly 0 after too few steps that trained is still an error", "[rules][zero-grad]") {
  TempDir dir;
  const Report r = trained_then_zero(dir, 2, 0.0);
  CHECK(required(r, "zero-gradients").severity == Severity::kError);
}

TEST_CASE("zero gradients under a loss that is not 0 after steps that trained are still an error", "[rules][zero-grad]") {
  // A path detached midway: the loss is there, its gradient is not.
  TempDir dir;
  const Report r = trained_then_zero(dir, 6, 0.3);
  const Finding& z = required(r, "zero-gradients");
  CHECK(z.severity == Severity::kError);
  CHECK_THAT(z.title, Catch::StartsWith("Every gradient was exactly zero"));
}

TEST_CASE("a gradient that arrived zero in a step with other gradients does not clear the loop of blame",
          "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("gradients-arrived-zero", "head.bias's gradient arrived from backward all zeros");
  f.step(65536, 65536, 1000.0);
  for (int i = 0; i < 8; ++i) f.step(65536, 65536, 0.0);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "zero-gradients") == nullptr);
  CHECK(find(r, "gradients-cleared") != nullptr);
}

TEST_CASE("a few steps whose gradients were all zero are not a cleared loop", "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) f.step(65536, 65536, i % 3 == 0 ? 0.0 : 1000.0);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "gradients-cleared") == nullptr);
}

namespace {

const char* kClearedDetail = "head.bias's gradient was set to None after micro-batches 1, 2, 3 of 4, before the next "
                             "one's backward: the optimizer step applied the gradients of micro-batch 4 alone";

// `steps` steps, with event accumulated-gradients-cleared at those `cleared` says.
template <typename Cleared>
Report accumulation_run(const TempDir& dir, int steps, Cleared cleared, bool scaler = true) {
  RunFixture f(dir.file("run.db"), kLayers);
  if (!scaler) f.meta("amp_dtype", "bfloat16").meta("scaler_enabled", "0");
  for (int i = 0; i < steps; ++i) {
    if (cleared(i)) f.event("accumulated-gradients-cleared", kClearedDetail);
    scaler ? f.step(65536, 65536) : f.step(1, 1);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("micro-batch gradients cleared at every step are an error with the accumulation loop's fix",
          "[rules][zero-grad]") {
  TempDir dir;
  const auto r = accumulation_run(dir, 6, [](int) { return true; });
  const Finding* c = find(r, "accumulated-gradients-cleared");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK_THAT(c->title, Catch::StartsWith("zero_grad() runs inside the gradient-accumulation loop"));
  CHECK_THAT(c->evidence, Catch::StartsWith("in 6 of the 6 steps from step 0, head.bias's gradient was set to None"));
  CHECK_THAT(c->suggestions.front().python,
             Catch::EndsWith("scaler.update()\n        optimizer.zero_grad()  # once per optimizer step"));
}

TEST_CASE("a micro-batch dropped at one step of many is a warning", "[rules][zero-grad]") {
  TempDir dir;
  const auto r = accumulation_run(dir, 20, [](int i) { return i == 7; });
  const Finding* c = find(r, "accumulated-gradients-cleared");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kWarning);
  CHECK_THAT(c->evidence, Catch::StartsWith("in 1 of the 13 steps from step 7"));
}

TEST_CASE("the steps after the agent's last recorded clearing do not count against it", "[rules][zero-grad]") {
  // The agent writes the event at the first 64 steps only: a loop that clears at every
  // step of 200 is not 64 of 200.
  TempDir dir;
  const auto r = accumulation_run(dir, 200, [](int i) { return i < 64; });
  const Finding* c = find(r, "accumulated-gradients-cleared");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK_THAT(c->evidence, Catch::StartsWith("in 64 of the 64 steps from step 0 (the first 64 recorded)"));
}

TEST_CASE("gradients cleared only in steps the scaler skipped are not a cleared loop", "[rules][zero-grad]") {
  // SAM leaves its weights where they were when the first gradient overflowed, then clears
  // it: a skipped step applied nothing, so it says nothing about accumulation.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) {
    const bool overflows = i % 2 == 0;
    if (overflows) f.event("accumulated-gradients-cleared", kClearedDetail);
    overflows ? f.step(65536, 32768, 1000.0, {kLayers.back()}) : f.step(32768, 65536);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(find(r, "accumulated-gradients-cleared") == nullptr);
}

TEST_CASE("cleared gradients are counted over the steps the optimizer took", "[rules][zero-grad]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  for (int i = 0; i < 12; ++i) {
    f.event("accumulated-gradients-cleared", kClearedDetail);
    i % 3 == 0 ? f.step(65536, 32768, 1000.0, {kLayers.back()}) : f.step(32768, 65536);
  }
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* c = find(r, "accumulated-gradients-cleared");
  REQUIRE(c != nullptr);
  CHECK(c->severity == Severity::kError);
  CHECK(c->steps == std::vector<std::int64_t>{1});
  CHECK_THAT(c->evidence, Catch::StartsWith("in 8 of the 8 steps from step 1 (not counting the 3 steps the scaler "
                                            "skipped, which applied nothing), head.bias's gradient"));
}

TEST_CASE("without a scaler the accumulation loop's fix steps the optimizer itself", "[rules][zero-grad]") {
  TempDir dir;
  const auto r = accumulation_run(dir, 6, [](int) { return true; }, /*scaler=*/false);
  const Finding* c = find(r, "accumulated-gradients-cleared");
  REQUIRE(c != nullptr);
  CHECK_THAT(c->suggestions.front().python,
             Catch::Contains("    loss.backward()\n    if (i + 1) % accumulation_steps == 0:\n        optimizer.step()\n"));
}
