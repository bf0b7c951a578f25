// The fp32-gradients decision (agent/core/fp32_gradients.h) on graphs described as the agents
// walk them: which parameters' every part is computed from a float32 gradient.
#include <catch2/catch.hpp>

#include <algorithm>

#include <string>
#include <vector>

#include "fp32_gradients.h"

using ampdiag::agent::fp32_gradient_params;
using ampdiag::agent::fp32_gradients_detail;
using ampdiag::agent::GradientGraph;
using Names = std::vector<std::string>;

TEST_CASE("a part computed from a float32 gradient names its parameter", "[fp32-gradients]") {
  // exp() of A_log's float32 value, under the loss's float32 Mean.
  const GradientGraph g{{"Mean", "Exp"}, {"float32", "float32"}, {{0, 1}}, {{1, "A_log"}}};
  CHECK(fp32_gradient_params(g) == Names{"A_log"});
}

TEST_CASE("a part autocast's cast hands on in fp16 does not", "[fp32-gradients]") {
  const GradientGraph g{{"Mean", "ToCopy"}, {"float32", "float16"}, {{0, 1}}, {{1, "lin.weight"}}};
  CHECK(fp32_gradient_params(g).empty());
}

TEST_CASE("a transpose under the cast hands on the fp16 values the cast received", "[fp32-gradients]") {
  // LibTorch's Linear: TBackward0 receives float32 from ToCopyBackward0, which received fp16.
  const GradientGraph g{{"Mm", "ToCopy", "T"}, {"float16", "float16", "float32"}, {{0, 1}, {1, 2}}, {{2, "w"}}};
  CHECK(fp32_gradient_params(g).empty());
}

TEST_CASE("an operation that computes under such a node makes new float32 values", "[fp32-gradients]") {
  // exp() of a parameter whose output went through a cast: its part is a float32 product.
  const GradientGraph g{{"ToCopy", "Exp"}, {"float16", "float32"}, {{0, 1}}, {{1, "A_log"}}};
  CHECK(fp32_gradient_params(g) == Names{"A_log"});
}

TEST_CASE("a part from a custom Function's backward does not", "[fp32-gradients]") {
  const GradientGraph g{{"Mean", ""}, {"float32", "float32"}, {{0, 1}}, {{1, "w"}}};
  CHECK(fp32_gradient_params(g).empty());
}

TEST_CASE("a parameter with one part in fp16 beside a float32 one is not named", "[fp32-gradients]") {
  // A tied weight: the embedding's float32 part, the head's fp16 one.
  const GradientGraph g{{"Mean", "Embedding", "ToCopy"},
                        {"float32", "float32", "float16"},
                        {{0, 1}, {0, 2}},
                        {{1, "emb.weight"}, {2, "emb.weight"}, {1, "pos.weight"}}};
  CHECK(fp32_gradient_params(g) == Names{"pos.weight"});
}

TEST_CASE("a dtype the walk could not read is not taken as float32", "[fp32-gradients]") {
  const GradientGraph g{{"Exp"}, {"?"}, {}, {{0, "A_log"}}};
  CHECK(fp32_gradient_params(g).empty());
}

TEST_CASE("the event names the parameters in order, up to its limit", "[fp32-gradients]") {
  CHECK(fp32_gradients_detail({"A_log", "emb.weight"}) == "A_log, emb.weight");
  CHECK(fp32_gradients_detail({}).empty());
  const Names many(ampdiag::agent::kFp32Named + 3, "p");
  const std::string detail = fp32_gradients_detail(many);
  CHECK(std::count(detail.begin(), detail.end(), ',') == long(ampdiag::agent::kFp32Named) - 1);
}
