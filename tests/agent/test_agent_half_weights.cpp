// The C++ agent's stalled-update counts of bf16 host parameters are a direct comparison's
// on the sampled steps, and the training is bit-identical with and without it
// (half_training.h; the CUDA case is in test_agent_cuda.cpp).
#include "../catch_with_torch.h"

#include "../rundb/temp_dir.h"
#include "half_training.h"
#include "tiny_training.h"

using namespace ampdiag::test;

TEST_CASE("the C++ agent's stalled-update counts are a direct comparison's on the sampled steps", "[agent][weights]") {
  TempDir dir;
  std::vector<UpdateRow> direct;
  const auto plain = train_half("", &direct);
  const auto watched = train_half(dir.file("half.db"), nullptr);
  REQUIRE(plain.size() == watched.size());
  for (std::size_t i = 0; i < plain.size(); ++i) REQUIRE(bitwise_equal(plain[i], watched[i]));
  const auto recorded = recorded_updates(dir.file("half.db"));
  REQUIRE(recorded == sampled(direct));
  REQUIRE(mostly_stalled(recorded));
}
