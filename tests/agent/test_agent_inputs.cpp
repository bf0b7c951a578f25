// Bad input to the agent gets a clear error before training starts, or is handled while
// training goes on: it never crashes the training and never loses the run silently.
#include "../catch_with_torch.h"

#include <cstdlib>

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {


// One fp16-autocast training step with an already-attached agent.
void one_step(torch::nn::Module& model, const std::function<torch::Tensor()>& forward, GradScaler& scaler,
              torch::optim::Optimizer& optimizer) {
  optimizer.zero_grad();
  torch::Tensor loss;
  {
    HalfAutocast autocast;
    loss = forward();
  }
  scaler.scale(loss).backward();
  scaler.step(optimizer);
  scaler.update();
  (void)model;
}

}  // namespace

TEST_CASE("an unwritable db path fails at attach, naming the path, and attaches nothing", "[agent][inputs]") {
  TinyNet net;
  GradScaler scaler;
  REQUIRE_THROWS_WITH(Agent(*net, scaler, options_for("/nonexistent-dir/run.db")), Catch::Contains("/nonexistent-dir/run.db"));
  CHECK(scaler.observer() == nullptr);
}

TEST_CASE("an existing run.db is not overwritten unless asked", "[agent][inputs]") {
  TempDir dir;
  TinyNet net;
  GradScaler scaler;
  { Agent first(*net, scaler, options_for(dir.file("run.db"))); }
  REQUIRE_THROWS_WITH(Agent(*net, scaler, options_for(dir.file("run.db"))), Catch::Contains("already exists"));
  auto o = options_for(dir.file("run.db"));
  o.overwrite = true;
  REQUIRE_NOTHROW(Agent(*net, scaler, o));
}

TEST_CASE("a disabled scaler, a second agent and bad options are refused", "[agent][inputs]") {
  TempDir dir;
  TinyNet net;
  GradScalerOptions off;
  off.enabled = false;
  GradScaler disabled(off);
  CHECK_THROWS_WITH(Agent(*net, disabled, options_for(dir.file("a.db"))), Catch::Contains("disabled"));
  GradScaler scaler;
  Agent first(*net, scaler, options_for(dir.file("b.db")));
  CHECK_THROWS_WITH(Agent(*net, scaler, options_for(dir.file("c.db"))), Catch::Contains("already has an agent"));
  first.close();
  auto bad = options_for(dir.file("d.db"));
  bad.every = 0;
  CHECK_THROWS_WITH(Agent(*net, scaler, bad), Catch::Contains("every"));
  bad = options_for(dir.file("e.db"));
  bad.queue_capacity = 1;
  CHECK_THROWS_WITH(Agent(*net, scaler, bad), Catch::Contains("queue_capacity"));
  bad = options_for(dir.file("g.db"));
  bad.amp_dtype = "fp16";
  CHECK_THROWS_WITH(Agent(*net, scaler, bad), Catch::Contains("amp_dtype must be \"float16\", \"bfloat16\" or empty"));
  torch::nn::Sequential empty;
  CHECK_THROWS_WITH(Agent(*empty, scaler, options_for(dir.file("f.db"))), Catch::Contains("no parameters"));
}

TEST_CASE("a full queue drops samples, counts them, and training goes on", "[agent][inputs]") {
  // 192 gradients arrive in one burst at each unscale, twelve times the queue: the writer
  // cannot drain it meanwhile, however the threads are scheduled (TinyNet's 6 could be, and
  // under a loaded ctest the test once saw no drop; 48, three times the queue, were drained
  // in time once the agent also read the weights' norms before the optimizer's step). A
  // producer preempted mid-burst lets the writer drain it: once in five full agent_tests
  // runs all 5 steps' bursts were drained, so 24 steps each get their chance to drop.
  TempDir dir;
  const auto db = dir.file("run.db");
  const auto train = [&](bool with_agent) {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int i = 0; i < 96; ++i) net->push_back(torch::nn::Linear(8, 8));
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
    GradScaler scaler;
    auto o = options_for(db);
    o.queue_capacity = 16;
    std::unique_ptr<Agent> agent = with_agent ? std::make_unique<Agent>(*net, scaler, o) : nullptr;
    const auto x = torch::randn({4, 8});
    for (int step = 0; step < 24; ++step) {
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        HalfAutocast autocast;
        loss = net->forward(x).to(torch::kFloat).pow(2).mean();
      }
      scaler.scale(loss).backward();
      scaler.step(optimizer);
      scaler.update();
    }
    if (agent) agent->close();
    return net->parameters();
  };
  const auto without = train(false), with = train(true);
  REQUIRE(with.size() == without.size());
  for (std::size_t i = 0; i < with.size(); ++i) CHECK(bitwise_equal(with[i], without[i]));  // training went on
  rundb::RunDbReader r(db);
  std::int64_t dropped = 0;
  const auto meta = r.meta();
  REQUIRE(meta.count("dropped_records") == 1);
  dropped = std::stoll(meta.at("dropped_records"));
  CHECK(dropped > 0);
  bool reported = false;
  for (const auto& e : r.events()) reported = reported || (e.kind == "dropped" && e.detail.find("queue_capacity") != std::string::npos);
  CHECK(reported);
}

TEST_CASE("frozen parameters are listed but get no statistics", "[agent][inputs]") {
  TempDir dir;
  TinyNet net;
  net->a->weight.set_requires_grad(false);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    const auto x = torch::randn({8, 16});
    one_step(*net, [&] { return net->c(torch::relu(net->b(torch::relu(net->a(x))))).to(torch::kFloat).pow(2).mean(); },
             scaler, optimizer);
  }
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK_FALSE(r.layers()[0].trainable);
  for (const auto& g : r.grad_stats()) CHECK(g.layer_id != 0);
  CHECK(r.grad_stats().size() == 5);
}

TEST_CASE("parameters without gradients in a step get no row that step", "[agent][inputs]") {
  TempDir dir;
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    const auto x = torch::randn({8, 32});
    // a is unused: its gradients stay undefined.
    one_step(*net, [&] { return net->c(torch::relu(net->b(x))).to(torch::kFloat).pow(2).mean(); }, scaler, optimizer);
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto grads = r.grad_stats();
  CHECK(grads.size() == 4);
  for (const auto& g : grads) CHECK(g.layer_id >= 2);
}

TEST_CASE("sparse gradients are recorded from their stored values", "[agent][inputs]") {
  TempDir dir;
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(100, 8).sparse(true));
  torch::optim::SGD optimizer(embedding->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  {
    Agent agent(*embedding, scaler, options_for(dir.file("run.db")));
    const auto ids = torch::tensor({1, 5, 5, 7}, torch::kLong);
    one_step(*embedding, [&] { return embedding(ids).pow(2).sum(); }, scaler, optimizer);
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto grads = r.grad_stats();
  REQUIRE(grads.size() == 1);
  CHECK(grads[0].stats.numel == 4 * 8);  // the stored (uncoalesced) rows, not 100 x 8
  bool noted = false;
  for (const auto& e : r.events()) noted = noted || e.kind == "sparse-gradient";
  CHECK(noted);
}

TEST_CASE("mixed parameter dtypes are all recorded; float64 goes through a copy", "[agent][inputs]") {
  TempDir dir;
  TinyNet net;
  net->c->to(torch::kDouble);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    const auto x = torch::randn({8, 16});
    one_step(*net, [&] { return net->c(torch::relu(net->b(torch::relu(net->a(x)))).to(torch::kDouble)).pow(2).mean().to(torch::kFloat); },
             scaler, optimizer);
  }
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK(r.grad_stats().size() == 6);
  CHECK(r.layers()[4].dtype == "float64");
  bool noted = false;
  for (const auto& e : r.events()) noted = noted || e.kind == "slow-path";
  CHECK(noted);
}

TEST_CASE("under torchrun each rank writes its own file", "[agent][inputs]") {
  TempDir dir;
  TinyNet net;
  GradScaler scaler;
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  std::string path;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    path = agent.status().db_path;
  }
  ::setenv("RANK", "two", 1);
  CHECK_THROWS_WITH(Agent(*net, scaler, options_for(dir.file("x.db"))), Catch::Contains("RANK='two'"));
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  CHECK(path == dir.file("run.rank1.db"));
  rundb::RunDbReader r(path);
  CHECK(r.meta().at("rank") == "1");
  CHECK(r.meta().at("world_size") == "2");
}
