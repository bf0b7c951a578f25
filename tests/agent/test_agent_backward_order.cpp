// Backward order with several backwards a step: a layer takes its place in the last
// backward that reached it (Session::backward_began, from autograd's graph task).
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
