// The precision the C++ agent judges a run in when AgentOptions::amp_dtype is left empty:
// what autocast runs in at the first training probe, followed when autocast turns on later.
#include "../catch_with_torch.h"

#include "tiny_setup.h"

using namespace ampdiag;
using namespace ampdiag::test;

TEST_CASE("amp_dtype left empty is what autocast runs in at the first training probe: bf16 with a scaler", "[agent]") {
  // A GradScaler kept with bf16 autocast: judged as float16, its bf16 values were held to fp16's range.
  TinySetup t;
  REQUIRE(t.options.amp_dtype.empty());
  train_with_agent(t, 2, at::kBFloat16, [&](Agent& agent, int) {
    const auto h = torch::relu(t.net->b(torch::relu(t.net->a(torch::randn({8, 16})))));
    return agent.probe("c", t.net->c(h)).to(torch::kFloat).mean();
  });
  CHECK(rundb::RunDbReader(t.dir.file("run.db")).meta().at("amp_dtype") == "bfloat16");
  CHECK(events_of(t, "amp-dtype").size() == 1);
}

TEST_CASE("amp_dtype left empty with autocast off and float32 outputs is a float32 run", "[agent]") {
  // AMP switched off: the run was judged by fp16's range.
  TinySetup t;
  {
    Agent agent(*t.net, t.scaler, t.options);
    for (int step = 0; step < 2; ++step) {
      t.optimizer.zero_grad();
      const auto h = torch::relu(t.net->b(torch::relu(t.net->a(torch::randn({8, 16})))));
      t.scaler.scale(agent.probe("c", t.net->c(h)).mean()).backward();
      t.scaler.step(t.optimizer);
      t.scaler.update();
    }
  }
  CHECK(rundb::RunDbReader(t.dir.file("run.db")).meta().at("amp_dtype") == "float32");
  CHECK(events_of(t, "amp-dtype").size() == 1);
}

TEST_CASE("amp_dtype left empty with a float32 warm-up before fp16 autocast is judged in float16 from then",
          "[agent]") {
  // It stayed float32 from the first probe, and the fp16 steps were held to float32's range.
  TinySetup t;
  {
    Agent agent(*t.net, t.scaler, t.options);
    for (int step = 0; step < 4; ++step) {
      t.optimizer.zero_grad();
      at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
      at::autocast::set_autocast_enabled(at::kCPU, step >= 2);
      const auto h = torch::relu(t.net->b(torch::relu(t.net->a(torch::randn({8, 16})))));
      const auto loss = agent.probe("c", t.net->c(h)).to(torch::kFloat).mean();
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      t.scaler.scale(loss).backward();
      t.scaler.step(t.optimizer);
      t.scaler.update();
    }
  }
  CHECK(rundb::RunDbReader(t.dir.file("run.db")).meta().at("amp_dtype") == "float16");
  const auto events = events_of(t, "amp-dtype");
  REQUIRE(events.size() == 2);
  CHECK(events.back() == std::pair<std::int64_t, std::string>{2, "autocast turned on in float16 at step 2, after a "
                                                                   "start in float32: the run is judged in float16"});
}

TEST_CASE("amp_dtype left empty under fp16 autocast stays float16, with no event", "[agent]") {
  TinySetup t;
  train_with_agent(t, 2, at::kHalf, [&](Agent& agent, int) {
    const auto h = torch::relu(t.net->b(torch::relu(t.net->a(torch::randn({8, 16})))));
    return agent.probe("c", t.net->c(h)).to(torch::kFloat).mean();
  });
  CHECK(rundb::RunDbReader(t.dir.file("run.db")).meta().at("amp_dtype") == "float16");
  CHECK(events_of(t, "amp-dtype").empty());
}
