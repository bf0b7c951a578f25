// Learning a camera's pose from keypoints with fp16 autocast on the CPU. The projection
// matrix intrinsic @ extrinsic has entries in the millions (focal lengths ~5000 px times
// translations ~1000 mm), beyond fp16's 65504: the forward matmul yields Inf and the
// loss is Inf/NaN. Pinning `projection` to FP32 (--pin-fp32 projection) fixes it.
#include <torch/torch.h>

#include "common/sample_cli.h"

using namespace ampdiag;

namespace {

constexpr std::int64_t kPoints = 256, kBatch = 8;

// Projects homogeneous world points (mm) to pixels with K @ [R | t].
struct ProjectionImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& intrinsic, const torch::Tensor& extrinsic, const torch::Tensor& points) {
    auto camera = torch::matmul(intrinsic, extrinsic);          // [b, 3, 4], entries ~1e6-1e7
    auto projected = torch::matmul(camera, points.transpose(1, 2));  // [b, 3, n]
    return projected.slice(1, 0, 2) / projected.slice(1, 2, 3);    // pixels
  }
};
TORCH_MODULE(Projection);

struct PoseModelImpl : torch::nn::Module {
  PoseModelImpl() {
    translation = register_parameter("translation", torch::tensor({{100.0f}, {-50.0f}, {1800.0f}}));
    encoder = register_module("encoder", torch::nn::Linear(2, 16));
    refine = register_module("refine", torch::nn::Linear(16, 2));
    projection = register_module("projection", Projection());
  }
  torch::Tensor translation;
  torch::nn::Linear encoder{nullptr}, refine{nullptr};
  Projection projection{nullptr};
};
TORCH_MODULE(PoseModel);

}  // namespace

int main(int argc, char** argv) try {
  const samples::SampleInfo info{"ampdiag_camera_projection",
                                 "intrinsic @ extrinsic with entries in the thousands overflows fp16 in forward",
                                 "camera_projection.db", 20, {"projection", "encoder", "refine"}};
  const auto args = samples::parse_sample_args(argc, argv, info);
  torch::manual_seed(args.seed);
  at::set_num_threads(2);

  PoseModel model;
  model->to(args.device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  GradScaler scaler;
  Agent agent(*model, scaler, samples::agent_options(args));
  const Fp32Pins pins(args.pins);

  const auto intrinsic = torch::tensor({{5000.0f, 0.0f, 960.0f}, {0.0f, 5000.0f, 540.0f}, {0.0f, 0.0f, 1.0f}})
                             .expand({kBatch, 3, 3})
                             .to(args.device);
  const auto rotation = torch::eye(3).expand({kBatch, 3, 3}).to(args.device);
  const auto points = torch::cat({torch::randn({kBatch, kPoints, 2}) * 400.0, torch::randn({kBatch, kPoints, 1}) * 100.0 + 3000.0,
                                  torch::ones({kBatch, kPoints, 1})}, 2).to(args.device);
  const auto true_t = torch::tensor({{0.0f}, {0.0f}, {2000.0f}}).expand({kBatch, 3, 1}).to(args.device);
  torch::Tensor target;
  {
    torch::NoGradGuard no_grad;
    target = model->projection(intrinsic, torch::cat({rotation, true_t}, 2), points);
  }
  samples::RunSummary summary;
  for (std::int64_t step = 0; step < args.steps; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      samples::Autocast autocast(args.device, at::kHalf);
      const auto extrinsic = torch::cat({rotation, model->translation.expand({kBatch, 3, 1})}, 2);
      torch::Tensor pixels;
      if (pins.pinned("projection")) {
        AutocastDisabled off;
        pixels = model->projection(to_fp32(intrinsic), to_fp32(extrinsic), to_fp32(points));
      } else {
        pixels = model->projection(intrinsic, extrinsic, points);
      }
      pixels = agent.probe("projection", pixels);
      // A small learned correction on normalised pixel coordinates.
      auto normalised = (pixels.transpose(1, 2) - 1000.0) / 1000.0;
      auto h = agent.probe("encoder", pins.run("encoder", [&](const torch::Tensor& in) { return torch::relu(model->encoder(in)); }, normalised));
      auto correction = agent.probe("refine", pins.run("refine", [&](const torch::Tensor& in) { return model->refine(in); }, h));
      loss = torch::mse_loss((normalised + 0.01 * correction).to(torch::kFloat),
                             ((target.transpose(1, 2) - 1000.0) / 1000.0).to(torch::kFloat));
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
