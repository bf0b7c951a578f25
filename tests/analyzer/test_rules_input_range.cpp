// A module whose input already held finite values fp16 cannot hold (event
// "input-beyond-fp16", written where its FP32 replay was finite under float16 autocast):
// autocast's cast made them Inf before it computed anything. Where that input is the
// model's own (unnormalised features), the data is what to fix, and the report says so first
// (tests/scenarios/test_input_range.py runs the same cases as real torch loops).
#include "rule_test.h"

namespace {

const char* kBeyond = "argument 0 (float32 [128, 64]): 37 of 8192 values at or beyond 65520, max |x| 221847";

// A run whose `module` goes NaN/Inf in forward in every step, its FP32 replay finite and its
// input beyond fp16's range (the model's input where `model_input`), with `amp_dtype`.
Report beyond_input(const TempDir& dir, const std::string& module, bool model_input,
                    const std::string& amp_dtype = "float16") {
  RunFixture f(dir.file("run.db"), {"fc.weight", "fc2.weight"});
  f.meta("amp_dtype", amp_dtype);
  f.finite_replay(module, 30000.0);
  f.event("input-beyond-fp16", module + ": " + kBeyond + (model_input ? "; the model's input" : ""));
  for (int i = 0; i < 4; ++i) f.activation("fc", module == "fc").activation("fc2", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

// The forward-nonfinite finding of beyond_input().
Finding forward_finding(const std::string& module, bool model_input, const std::string& amp_dtype = "float16") {
  TempDir dir;
  const Report r = beyond_input(dir, module, model_input, amp_dtype);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  return *fw;
}

}  // namespace

TEST_CASE("a model input beyond fp16's range is named as the cause, the first module as where it turns Inf",
          "[rules][input-range]") {
  const Finding f = forward_finding("fc", true);
  const Finding* fw = &f;
  CHECK(fw->module == "fc");
  CHECK(fw->title == "The model's input holds values beyond fp16's range: fc, the first module to use them, turns them "
                     "into Inf");
  CHECK_THAT(fw->evidence, Catch::EndsWith(std::string("(") + kBeyond + ", the model's input itself): autocast casts "
                                           "them to Inf for its fp16 operations before it computes anything"));
}

TEST_CASE("a model input beyond fp16's range gets the data's scaling first, then the confirmed pin", "[rules][input-range]") {
  TempDir dir;
  const Report r = beyond_input(dir, "fc", true);
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  REQUIRE(fw->suggestions.size() >= 2);
  CHECK_THAT(fw->suggestions[0].summary, Catch::StartsWith("Bring the model's input into fp16's range"));
  CHECK_THAT(fw->suggestions[0].python, Catch::Contains("x = (x - mean) / std"));
  CHECK_THAT(fw->suggestions[1].python, Catch::StartsWith("ampdiag.pin_fp32(model.fc)"));
  // The scaling ran in no replay: the text does not mark it confirmed.
  CHECK_THAT(render_text(r, Gate("error")), !Catch::Contains("anything. (confirmed by replay)"));
}

TEST_CASE("an inner module's input beyond fp16's range is named, and its confirmed pin stays the fix",
          "[rules][input-range]") {
  const Finding f = forward_finding("fc2", false);
  const Finding* fw = &f;
  CHECK(fw->title == "fc2's input already holds values beyond fp16's range, which it turns into Inf");
  CHECK_THAT(fw->evidence, !Catch::Contains("the model's input itself"));
  CHECK_THAT(fw->suggestions.front().python, Catch::StartsWith("ampdiag.pin_fp32(model.fc2)"));
}

TEST_CASE("an input beyond fp16's range says nothing in a bfloat16 run", "[rules][input-range]") {
  const Finding f = forward_finding("fc", true, "bfloat16");
  const Finding* fw = &f;
  CHECK(fw->title == "fc is the first module whose output is NaN/Inf in forward");
  CHECK_THAT(fw->evidence, !Catch::Contains("beyond fp16's range"));
}

TEST_CASE("a model input the agent names as the model's argument is not called the model's input twice",
          "[rules][input-range]") {
  TempDir dir;
  RunFixture f(dir.file("run.db"), {"fc.weight", "fc2.weight"});
  f.finite_replay("fc", 30000.0);
  f.event("input-beyond-fp16", std::string("fc: the model's argument 1 (float32 [128, 64]): 37 of 8192 values at or "
                                           "beyond 65520, max |x| 221847; the model's input"));
  for (int i = 0; i < 4; ++i) f.activation("fc", true).step(65536, 32768, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding* fw = find(r, "forward-nonfinite");
  REQUIRE(fw != nullptr);
  CHECK_THAT(fw->title, Catch::StartsWith("The model's input holds values beyond fp16's range: fc,"));
  CHECK_THAT(fw->evidence, Catch::Contains("(the model's argument 1 (float32 [128, 64]): 37 of 8192 values at or "
                                           "beyond 65520, max |x| 221847): autocast casts"));
}
