// Malformed input to the CPU engine fails loudly and names what is wrong.
#include <catch2/catch.hpp>

#include <stdexcept>

#include "ampdiag/kernels/cpu_stats.h"

using namespace ampdiag::kernels;

TEST_CASE("a negative numel is rejected with the tensor's index", "[inputs]") {
  CpuStatsEngine engine;
  float x = 1.0f;
  TensorRef refs[2] = {{&x, 1, DType::kFloat32}, {&x, -5, DType::kFloat32}};
  TensorStats out[2];
  REQUIRE_THROWS_WITH(engine.compute(refs, 2, out), Catch::Contains("tensor 1") && Catch::Contains("-5"));
}

TEST_CASE("null data with elements is rejected", "[inputs]") {
  CpuStatsEngine engine;
  TensorRef ref{nullptr, 3, DType::kFloat16};
  TensorStats out;
  REQUIRE_THROWS_AS(engine.compute(&ref, 1, &out), std::invalid_argument);
}

TEST_CASE("an unknown dtype code is rejected", "[inputs]") {
  CpuStatsEngine engine;
  float x = 1.0f;
  TensorRef ref{&x, 1, static_cast<DType>(9)};
  TensorStats out;
  REQUIRE_THROWS_WITH(engine.compute(&ref, 1, &out), Catch::Contains("dtype"));
}

TEST_CASE("an empty tensor with null data has zero statistics", "[inputs]") {
  CpuStatsEngine engine;
  TensorRef ref{nullptr, 0, DType::kBFloat16};
  TensorStats out;
  out.nan = 99;
  REQUIRE_FALSE(engine.compute(&ref, 1, &out));
  REQUIRE(out.numel == 0);
  REQUIRE(out.nan == 0);
  REQUIRE(out.absmax == 0.0f);
  REQUIRE(out.l2 == 0.0);
}

TEST_CASE("a call with no tensors does nothing", "[inputs]") {
  CpuStatsEngine engine;
  REQUIRE_FALSE(engine.compute(nullptr, 0, nullptr));
}

TEST_CASE("engine options out of range are rejected", "[inputs]") {
  CpuEngineOptions bad_chunk;
  bad_chunk.chunk_elements = 10;
  REQUIRE_THROWS_WITH(CpuStatsEngine(bad_chunk), Catch::Contains("chunk_elements"));
  CpuEngineOptions bad_threads;
  bad_threads.threads = -1;
  REQUIRE_THROWS_WITH(CpuStatsEngine(bad_threads), Catch::Contains("threads"));
}
