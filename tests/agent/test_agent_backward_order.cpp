// Backward order with several backwards a step: a layer takes its place in the last
// backward that reached it (Session::backward_began, from autograd's graph task). And a
// module run again and again in a forward, each call on the last one's output, whose shared
// parameters' order says nothing about which call made a NaN/Inf (event "chained-calls").
#include <catch2/catch.hpp>

#include <map>
#include <string>

#include "tiny_setup.h"

using namespace ampdiag;
using namespace ampdiag::test;

TEST_CASE("a second loss's own backward places the shared layer after its head", "[agent]") {
  // The tiny net read as a trunk (a), a main head (c) and an auxiliary head (b), each loss
  // given its own backward: the first reaches c then a, the second b then a again.
  TinySetup t;
  {
    Agent agent(*t.net, t.scaler, t.options);
    for (int step = 0; step < 2; ++step) {
      t.optimizer.zero_grad();
      torch::Tensor main, aux;
      {
        HalfAutocast autocast;
        const auto h = torch::relu(t.net->a(torch::randn({8, 16})));
        main = t.net->c(h).pow(2).mean();
        aux = t.net->b(h).pow(2).mean();
      }
      t.scaler.scale(main).backward({}, /*retain_graph=*/true);
      t.scaler.scale(aux).backward();
      t.scaler.step(t.optimizer);
      t.scaler.update();
    }
  }
  rundb::RunDbReader r(t.dir.file("run.db"));
  const auto layers = r.layers();
  std::map<std::string, std::int64_t> order;
  for (const auto& g : r.grad_stats())
    if (g.step == 1) order[layers[std::size_t(g.layer_id)].name] = g.bwd_order;
  CHECK(order.at("c.weight") < order.at("b.weight"));
  CHECK(order.at("b.weight") < order.at("a.weight"));
}

TEST_CASE("a module run through forward() on its own last output is recorded as chained, once", "[agent]") {
  // A block shared by three depths, as ALBERT's: overflow-origin names it, not its first parameter.
  TinySetup t;
  train_with_agent(t, 3, at::kHalf, [&](Agent& agent, int) {
    auto h = agent.forward("a", t.net->a, agent.input("x", torch::randn({8, 16})));
    for (int depth = 0; depth < 3; ++depth) h = agent.forward("b", t.net->b, h);
    return agent.forward("c", t.net->c, h).to(torch::kFloat).pow(2).mean();
  });
  const auto events = events_of(t, "chained-calls");
  REQUIRE(events.size() == 1);
  CHECK(events[0] == std::make_pair(std::int64_t(0), std::string("b")));
}

TEST_CASE("a module run through forward() on two inputs of its own is not chained", "[agent]") {
  // One encoder on two views: each call's backward is its own.
  TinySetup t;
  train_with_agent(t, 3, at::kHalf, [&](Agent& agent, int) {
    const auto x = agent.input("x", torch::randn({8, 16}));
    const auto one = agent.forward("b", t.net->b, torch::relu(agent.forward("a", t.net->a, x)));
    const auto two = agent.forward("b", t.net->b, torch::relu(agent.forward("a", t.net->a, x.flip(0))));
    return agent.forward("c", t.net->c, one - two).to(torch::kFloat).pow(2).mean();
  });
  CHECK(events_of(t, "chained-calls").empty());
}
