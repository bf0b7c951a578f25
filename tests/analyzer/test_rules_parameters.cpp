// NaN/Inf stored in the parameters, which the agent finds when a step goes NaN/Inf with a
// finite input (event "parameters-nonfinite"): written by an update from finite gradients
// (fp16 parameters with Adam's eps=1e-8), or there before any update (a checkpoint). The
// update or the model is named, never the module whose weights hold them
// (tests/scenarios/test_loss_diagnosis.py runs the same cases as real torch loops).
#include "rule_test.h"

namespace {

const char* kFound = "2 of 4 parameter tensors: a.weight, a.bias";

// A run without a scaler whose parameters the agent finds NaN/Inf at step `found` (enc's
// output NaN, its FP32 replay "intrinsic": its weights make NaN from finite inputs),
// after `found` finite steps; every step from then on is NaN. `events`: more agent events
// on that step.
// `at_attach`: what the agent read of the parameters at attach() (meta), where given.
Report parameters_found_at(TempDir& dir, int found, const std::string& dtype = "Float",
                           const std::vector<std::pair<std::string, std::string>>& events = {},
                           const std::string& at_attach = "") {
  RunFixture f(dir.file("run.db"), kLayers, 0, 1, dtype);
  f.meta("scaler_enabled", "0").replay("enc", "intrinsic");
  if (!at_attach.empty()) f.meta("parameters_at_attach", at_attach);
  for (int i = 0; i < found; ++i) f.activation("enc", false).step(1, 1);
  f.event("parameters-nonfinite", kFound);
  for (const auto& [kind, detail] : events) f.event(kind, detail);
  for (int i = 0; i < 3; ++i) f.activation("enc", true).taken().step(1, 1, 1000, {"head.weight", "a.weight"}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an update from finite gradients that left NaN in the parameters is named, not the module holding them", "[rules]") {
  TempDir dir;
  const Report r = parameters_found_at(dir, 2);
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK(u->severity == Severity::kError);
  CHECK(u->steps == std::vector<std::int64_t>{1});  // the last update before step 2
  CHECK_THAT(u->title, Catch::Contains("from finite gradients, by step 1's update"));
  CHECK_THAT(u->evidence, Catch::Contains(kFound));
  CHECK_THAT(u->evidence, Catch::Contains("3 of the 3 steps after it went NaN/Inf"));
  CHECK(find(r, "forward-nonfinite") == nullptr);  // not enc's code: its weights
  CHECK(find(r, "nonfinite-parameters") == nullptr);
}

TEST_CASE("fp32 parameters made NaN by an update get the optimizer to look at, with no code to paste", "[rules]") {
  TempDir dir;
  const Report r = parameters_found_at(dir, 1);
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  REQUIRE(u->suggestions.size() == 1);
  CHECK_THAT(u->suggestions.front().summary, Catch::Contains("learning rate"));
  CHECK(u->suggestions.front().python.empty());
}

TEST_CASE("float16 parameters under an Adam eps that rounds to 0 get eps raised, then FP32 master weights", "[rules]") {
  TempDir dir;
  const Report r = parameters_found_at(dir, 1, "float16", {{"optimizer-eps", "Adam eps=1e-08 is 0 in float16"}});
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK_THAT(u->evidence, Catch::Contains("Adam eps=1e-08 is 0 in float16"));
  REQUIRE(u->suggestions.size() == 2);
  CHECK_THAT(u->suggestions[0].python, Catch::Contains("group[\"eps\"] = 1e-4"));
  CHECK_THAT(u->suggestions[1].python, Catch::Contains("model = model.float()"));
}

TEST_CASE("float16 parameters made NaN without an eps to blame get FP32 master weights only", "[rules]") {
  TempDir dir;
  const Report r = parameters_found_at(dir, 1, "float16");
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  REQUIRE(u->suggestions.size() == 1);
  CHECK_THAT(u->suggestions.front().summary, Catch::StartsWith("Keep FP32 master weights"));
}

TEST_CASE("parameters found NaN before any update came with the model", "[rules]") {
  TempDir dir;
  const Report r = parameters_found_at(dir, 0);
  const Finding* p = find(r, "nonfinite-parameters");
  REQUIRE(p != nullptr);
  CHECK(p->severity == Severity::kError);
  CHECK(p->steps == std::vector<std::int64_t>{0});
  CHECK_THAT(p->evidence, Catch::Contains("3 of the 3 steps from step 0 on went NaN/Inf"));
  CHECK_THAT(p->suggestions.front().summary, Catch::Contains("checkpoint"));
  CHECK(find(r, "nonfinite-update") == nullptr);
  CHECK(find(r, "forward-nonfinite") == nullptr);
  REQUIRE(r.skipped.empty());
}

TEST_CASE("parameters found NaN before any update that were finite at attach were written outside the optimizer",
          "[rules]") {
  // SAM's first_step() added rho times gradients the scale had overflowed, within step 0.
  TempDir dir;
  const Report r = parameters_found_at(dir, 0, "Float", {}, "finite");
  const Finding* p = find(r, "nonfinite-parameters");
  REQUIRE(p != nullptr);
  CHECK(p->title == "The parameters went NaN/Inf by step 0 before any optimizer step recorded: code outside the "
                    "optimizer wrote them");
  CHECK_THAT(p->evidence, Catch::Contains("they were all finite when attach() read them"));
  CHECK_THAT(p->suggestions.front().summary, Catch::StartsWith("Look at what writes the parameters outside the "
                                                               "optimizer's step: a sharpness-aware (SAM) first_step()"));
}

TEST_CASE("parameters found NaN before any update that held NaN at attach came with the model", "[rules]") {
  TempDir dir;
  const Report r = parameters_found_at(dir, 0, "Float", {}, "nonfinite");
  const Finding* p = find(r, "nonfinite-parameters");
  REQUIRE(p != nullptr);
  CHECK_THAT(p->title, Catch::EndsWith("they came with the model"));
}

TEST_CASE("a skipped step wrote nothing: the update named is the last one the scaler let through", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.activation("enc", false).step(65536, 65536);                        // 0: taken
  f.activation("enc", false).step(65536, 32768, 1000, {"head.weight"});  // 1: skipped
  f.event("parameters-nonfinite", kFound).activation("enc", true).step(32768, 16384, 1000, {"a.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK(u->steps == std::vector<std::int64_t>{0});
  REQUIRE(r.skipped.size() == 2);
  CHECK(r.skipped.back().forward == ForwardSource::kUpdate);
}

TEST_CASE("an update that applied NaN gradients before the parameters were found stays the one named", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.meta("scaler_enabled", "0");
  f.activation("enc", false).step(1, 1);
  f.activation("enc", false).taken().step(1, 1, 1000, {"head.weight"});  // 1: NaN gradients applied
  f.event("parameters-nonfinite", kFound).activation("enc", true).taken().step(1, 1, 1000, {"a.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding* u = find(r, "nonfinite-update");
  REQUIRE(u != nullptr);
  CHECK(u->steps == std::vector<std::int64_t>{1});
  CHECK_THAT(u->title, Catch::Contains("applied NaN/Inf gradients"));
}

TEST_CASE("the skips and the scale's fall on NaN parameters point to them, not to an overflow", "[rules]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), kLayers);
  f.event("parameters-nonfinite", kFound);
  double scale = 65536;
  for (int i = 0; i < 24; ++i, scale /= 2) f.activation("enc", true).step(scale, scale / 2, 1000, {"head.weight"}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  for (const char* rule : {"scale-collapse", "skip-rate"}) {
    const Finding* symptom = find(r, rule);
    REQUIRE(symptom != nullptr);
    REQUIRE(symptom->suggestions.size() == 1);
    CHECK_THAT(symptom->suggestions.front().summary, Catch::StartsWith("Fix the NaN/Inf the parameters held from the start"));
  }
  CHECK(find(r, "overflow-origin") == nullptr);
}
