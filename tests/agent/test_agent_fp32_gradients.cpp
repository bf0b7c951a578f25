// Event "fp32-gradients" from the C++ agent: the parameters whose every backward part autocast
// computes in FP32, read once from the first scaled loss's graph (agent/src/fp32_gradients.h).
#include "../catch_with_torch.h"

#include <string>
#include <vector>

#include "../rundb/temp_dir.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

// A custom Function whose backward computes in fp16 what it receives in float32.
struct HalfProduct : torch::autograd::Function<HalfProduct> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    return (x.to(torch::kHalf) * w.to(torch::kHalf)).to(torch::kFloat);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const auto half = g[0].to(torch::kHalf);
    return {(half * saved[1].to(torch::kHalf)).to(torch::kFloat),
            (half * saved[0].to(torch::kHalf)).sum(0).to(torch::kFloat)};
  }
};

// A Mamba-like block: A_log enters through exp() of its float32 value; lin and head are
// Linears autocast casts to fp16; w enters through HalfProduct only.
struct MixerImpl : torch::nn::Module {
  MixerImpl() {
    lin = register_module("lin", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 1));
    A_log = register_parameter("A_log", torch::zeros({8}));
    w = register_parameter("w", torch::ones({8}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = lin(x) * torch::exp(A_log.to(torch::kFloat)) + HalfProduct::apply(x, w);
    return head(h);
  }
  torch::nn::Linear lin{nullptr}, head{nullptr};
  torch::Tensor A_log, w;
};
TORCH_MODULE(Mixer);

}  // namespace

TEST_CASE("the C++ agent names the parameters whose gradients autocast computes in FP32, once, not one a custom "
          "Function hands its part",
          "[agent][fp32-gradients]") {
  TempDir dir;
  torch::manual_seed(0);
  Mixer net;
  agent_steps(*net, dir.file("run.db"), 3, 0.1,
              [&](Agent&) { return net->forward(torch::randn({4, 8})).to(torch::kFloat).mean(); });
  CHECK(event_details(dir.file("run.db"), "fp32-gradients") == std::vector<std::string>{"A_log"});
}
