// Linear attention trained with fp16 autocast on the CPU: its normaliser, a sum of the
// positive key features over a long sequence, exceeds fp16's 65504 in the forward pass,
// the division turns Inf/Inf into NaN and the loss is NaN from the first step. Pinning
// encoder.0.linear_attn to FP32 (--pin-fp32 encoder.0.linear_attn) fixes it.
#include <torch/torch.h>

#include "common/sample_cli.h"

using namespace ampdiag;

namespace {

constexpr std::int64_t kDim = 16, kTokens = 4096, kBatch = 2;

struct LinearAttentionImpl : torch::nn::Module {
  LinearAttentionImpl() {
    q = register_module("q", torch::nn::Linear(kDim, kDim));
    k = register_module("k", torch::nn::Linear(kDim, kDim));
    v = register_module("v", torch::nn::Linear(kDim, kDim));
    out = register_module("out", torch::nn::Linear(kDim, kDim));
  }
  // phi(x) = elu(x) + 1 > 0; y_i = phi(q_i) (sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j))
  torch::Tensor forward(const torch::Tensor& x) {
    auto fq = torch::elu(q(x)) + 1, fk = torch::elu(k(x)) + 1, vv = v(x);
    auto kv = torch::matmul(fk.transpose(1, 2), vv);           // [b, d, d], a sum over tokens
    auto normaliser = fk.sum(1, /*keepdim=*/true);             // [b, 1, d], the sum that overflows
    auto denom = (fq * normaliser).sum(-1, /*keepdim=*/true);  // [b, t, 1]
    return out(torch::matmul(fq, kv) / denom);
  }
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr};
};
TORCH_MODULE(LinearAttention);

struct EncoderLayerImpl : torch::nn::Module {
  EncoderLayerImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    linear_attn = register_module("linear_attn", LinearAttention());
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(kDim, 2 * kDim), torch::nn::ReLU(),
                                                       torch::nn::Linear(2 * kDim, kDim)));
  }
  torch::nn::LayerNorm norm{nullptr};
  LinearAttention linear_attn{nullptr};
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(EncoderLayer);

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    embed = register_module("embed", torch::nn::Linear(kDim, kDim));
    encoder = register_module("encoder", torch::nn::ModuleList());
    layers.push_back(EncoderLayer());
    encoder->push_back(layers.back());
    head = register_module("head", torch::nn::Linear(kDim, 1));
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList encoder{nullptr};
  std::vector<EncoderLayer> layers;
};
TORCH_MODULE(Model);

}  // namespace

int main(int argc, char** argv) try {
  const samples::SampleInfo info{"ampdiag_linear_attention_nan",
                                 "the linear-attention normaliser (a sum over 4096 tokens) overflows fp16 in forward: NaN loss",
                                 "linear_attention_nan.db", 40, {"encoder.0.linear_attn", "encoder.0.mlp", "head"}};
  const auto args = samples::parse_sample_args(argc, argv, info);
  torch::manual_seed(args.seed);
  at::set_num_threads(2);

  Model model;
  model->to(args.device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  GradScaler scaler;
  Agent agent(*model, scaler, samples::agent_options(args));
  const Fp32Pins pins(args.pins);

  // Inputs with a positive mean: the key features phi(k) are ~5-10 on every token.
  const auto inputs = (torch::randn({kBatch, kTokens, kDim}) + 2.0).to(args.device);
  const auto targets = torch::randn({kBatch, 1}).to(args.device);
  samples::RunSummary summary;
  for (std::int64_t step = 0; step < args.steps; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      samples::Autocast autocast(args.device, at::kHalf);
      auto x = agent.probe("embed", model->embed(inputs) * 3.0);
      auto& layer = model->layers[0];
      auto a = pins.run("encoder.0.linear_attn", [&](const torch::Tensor& in) { return layer->linear_attn(in); },
                        layer->norm(x));
      x = x + agent.probe("encoder.0.linear_attn", a);
      auto m = pins.run("encoder.0.mlp", [&](const torch::Tensor& in) { return layer->mlp->forward(in); }, x);
      x = x + agent.probe("encoder.0.mlp", m);
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
