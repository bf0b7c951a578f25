// overflow-origin where other modules' own backward overflowed in the same skips as the
// module it names (events "companion-output-gradient" for the modules watched beside it): the
// named module pinned alone would leave theirs, so they are pinned with it.
#include "rule_test.h"

namespace {

// 12 skipped steps halving the scale from 65536, out's gradients finite and k's the first
// NaN/Inf ones, then those of `beside` (q's unless said); `events` written at the third
// ("k: finite" the named module's verdict, "q: finite, beside k" a companion's). Then 4
// finite steps at the scale they left, 16, where k's gradients reach 1000 and q's 0.9 of that.
Report beside_run(const std::vector<std::string>& events, const std::vector<std::string>& beside = {"q.weight"}) {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"out.weight", "k.weight", "q.weight", "v.weight"});
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2) {
    if (i == 2)
      for (const auto& e : events)
        f.event(e.find(", beside ") == std::string::npos ? "module-output-gradient" : "companion-output-gradient", e);
    std::vector<std::string> nonfinite{"k.weight"};
    nonfinite.insert(nonfinite.end(), beside.begin(), beside.end());
    f.finite_first({"out.weight"}).step(scale, scale / 2, 1000, nonfinite);
  }
  f.absmax_times("q.weight", 0.9).absmax_times("out.weight", 0.1).absmax_times("v.weight", 0.5);
  for (int i = 0; i < 4; ++i) f.step(scale, scale, 1000);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("a module whose own backward overflowed in the same skips is pinned with the one named",
          "[rules][own-overflows]") {
  // Two projections of one large input: q's weight gradient overflows beside k's, not from it.
  const Report r = beside_run({"k: finite", "q: finite, beside k"});
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.module == "k");
  CHECK(o.title == "k overflows first in backward, and q in its own backward in the same steps");
  CHECK_THAT(o.evidence, Catch::Contains("at step 2 q.weight went NaN/Inf too, after k's, with the gradient reaching "
                                         "q's output finite: q's own backward overflowed as well, not k's NaN/Inf "
                                         "passed on"));
  REQUIRE(o.suggestions.size() == 2);
  // k pinned alone, the scale could rise no further than where q's gradients fit: barely.
  CHECK(o.suggestions[0].summary == "Run k and q in FP32 together: pinned alone, k would leave q's overflow, and the "
                                    "scale would still have to come down to where its gradients fit (q's up to 56.25 "
                                    "unscaled, against k's 62.5).");
  CHECK(o.suggestions[0].python == "ampdiag.pin_fp32(model.k)  # autocast off inside each; float inputs cast\n"
                                   "ampdiag.pin_fp32(model.q)");
  CHECK_THAT(o.suggestions[0].cpp, Catch::Contains("ampdiag::Fp32Pins pins({\"k\", \"q\"});"));
  CHECK_THAT(o.suggestions[1].summary, Catch::Contains("bfloat16"));
}

TEST_CASE("several modules overflowing beside the one named are all pinned with it", "[rules][own-overflows]") {
  const Report r = beside_run({"k: finite", "q: finite, beside k", "v: finite, beside k"}, {"q.weight", "v.weight"});
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.title == "k overflows first in backward, and q and v in their own backward in the same steps");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK(o.suggestions[0].summary == "Run k, q and v in FP32 together: pinned alone, k would leave q and v's overflow, "
                                    "and the scale would still have to come down to where their gradients fit (q's up "
                                    "to 56.25, v's up to 31.25 unscaled, against k's 62.5).");
  CHECK_THAT(o.suggestions[0].cpp, Catch::Contains("ampdiag::Fp32Pins pins({\"k\", \"q\", \"v\"});"));
}

TEST_CASE("a module that received the NaN/Inf through its output is not pinned beside the one named",
          "[rules][own-overflows]") {
  // q's NaN/Inf came from k's backward (a chain: k given q's output): k's pin covers it.
  const Report r = beside_run({"k: finite", "q: nonfinite, beside k"});
  const Finding& o = required(r, "overflow-origin");
  CHECK(o.title == "k overflows first in backward: its gradients go non-finite before any other layer's");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run k in FP32"));
}

TEST_CASE("a verdict for a module whose gradients stayed finite in that skip pins nothing beside the one named",
          "[rules][own-overflows]") {
  const Report r = beside_run({"k: finite", "v: finite, beside k"});
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run k in FP32"));
}

TEST_CASE("a verdict beside another module pins nothing beside this one", "[rules][own-overflows]") {
  const Report r = beside_run({"k: finite", "q: finite, beside out"});
  const Finding& o = required(r, "overflow-origin");
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Run k in FP32"));
}
