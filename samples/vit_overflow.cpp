// A small pre-norm ViT-style transformer trained with fp16 autocast on the CPU whose
// attention block in block1.0 produces gradients too large for fp16: its backward
// overflows again and again, every overflow skips a step and halves the loss scale, and
// the scale slides far below NVIDIA's recommended minimum of 128. Pinning block1.0.attn
// to FP32 (--pin-fp32 block1.0.attn) keeps those gradients in fp32 and the run healthy.
//
// The planted fault: block1.0's attention computes attn @ (v / kGain) and scales the
// result back up by kGain, as numerically careless attention code does. Forward values
// and true gradients are ordinary, but in backward the fp16 gradient of that product is
// kGain times larger than anything else: it overflows unless the loss scale is tiny.
#include <torch/torch.h>

#include <cmath>

#include "common/sample_cli.h"

using namespace ampdiag;

namespace {

constexpr std::int64_t kDim = 32, kHeads = 4, kTokens = 16, kBatch = 32, kDepth = 2;
constexpr double kGain = 3.0e5;

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(double gain = 1.0) : gain(gain) {
    qkv = register_module("qkv", torch::nn::Linear(kDim, 3 * kDim));
    proj = register_module("proj", torch::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), hd = kDim / kHeads;
    auto parts = qkv(x).reshape({b, t, 3, kHeads, hd}).permute({2, 0, 3, 1, 4});
    auto q = parts[0], k = parts[1], v = parts[2];
    auto attn = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hd)), -1);
    auto y = torch::matmul(attn, v / gain).transpose(1, 2).reshape({b, t, kDim});
    return proj(y * gain);
  }
  double gain;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(Attention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(double attention_gain) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    attn = register_module("attn", Attention(attention_gain));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(kDim, 4 * kDim), torch::nn::GELU(),
                                                       torch::nn::Linear(4 * kDim, kDim)));
  }
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  Attention attn{nullptr};
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(Block);

struct VitImpl : torch::nn::Module {
  VitImpl() {
    embed = register_module("embed", torch::nn::Linear(kDim, kDim));
    block1 = register_module("block1", torch::nn::ModuleList());
    for (int i = 0; i < kDepth; ++i) {
      blocks.push_back(Block(i == 0 ? kGain : 1.0));
      block1->push_back(blocks.back());
    }
    head = register_module("head", torch::nn::Linear(kDim, 1));
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList block1{nullptr};
  std::vector<Block> blocks;
};
TORCH_MODULE(Vit);

}  // namespace

int main(int argc, char** argv) try {
  const samples::SampleInfo info{
      "ampdiag_vit_overflow", "attention gradients in block1.0.attn overflow fp16; the loss scale keeps backing off",
      "vit_overflow.db", 60, {"block1.0.attn", "block1.1.attn", "block1.0.mlp", "head"}};
  const auto args = samples::parse_sample_args(argc, argv, info);
  torch::manual_seed(args.seed);
  at::set_num_threads(2);

  Vit model;
  model->to(args.device);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  GradScalerOptions scaler_options;
  scaler_options.growth_interval = 10;  // short, so a 60-step demo shows the scale trying to recover
  GradScaler scaler(scaler_options);
  Agent agent(*model, scaler, samples::agent_options(args));
  const Fp32Pins pins(args.pins);

  const auto inputs = torch::randn({kBatch, kTokens, kDim}).to(args.device);
  const auto targets = torch::randn({kBatch, 1}).to(args.device);
  samples::RunSummary summary;
  for (std::int64_t step = 0; step < args.steps; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      samples::Autocast autocast(args.device, at::kHalf);
      auto x = agent.probe("embed", model->embed(inputs));
      for (int i = 0; i < kDepth; ++i) {
        auto& block = model->blocks[std::size_t(i)];
        const std::string path = "block1." + std::to_string(i);
        auto a = pins.run(path + ".attn", [&](const torch::Tensor& in) { return block->attn(in); }, block->norm1(x));
        x = x + agent.probe(path + ".attn", a);
        auto m = pins.run(path + ".mlp", [&](const torch::Tensor& in) { return block->mlp->forward(in); }, block->norm2(x));
        x = x + agent.probe(path + ".mlp", m);
      }
      auto out = pins.run("head", [&](const torch::Tensor& in) { return model->head(in); }, x.mean(1));
      loss = torch::mse_loss(agent.probe("head", out).to(torch::kFloat), targets);
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
    // The scale after update(), as the report's timeline and "lowest" show it.
    summary.step(loss, scaler.last_step_skipped(), scaler);
  }
  agent.close();
  summary.print(info, args, agent);
  return 0;
} catch (const std::exception& e) {
  return samples::exit_with_error(argv[0], e);  // e.g. the run.db cannot be created: one line, exit 2
}
