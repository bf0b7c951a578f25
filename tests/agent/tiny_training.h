// A tiny fp16-autocast training loop for the agent tests, with optional agent and an
// initial loss scale high enough that the first steps overflow and are skipped.
#pragma once

#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <functional>
#include <string>
#include <vector>

#include "ampdiag/agent.h"
#include "ampdiag/grad_scaler.h"
#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/rows.h"

namespace ampdiag::test {

struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    a = register_module("a", torch::nn::Linear(16, 32));
    b = register_module("b", torch::nn::Linear(32, 32));
    c = register_module("c", torch::nn::Linear(32, 1));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(TinyNet);

// fp16 autocast (or `dtype`'s) on `type` (the CPU unless said) for its lifetime.
struct HalfAutocast {
  explicit HalfAutocast(c10::DeviceType type = c10::DeviceType::CPU, at::ScalarType dtype = at::kHalf) : type(type) {
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::increment_nesting();
  }
  ~HalfAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type, false);
  }
  c10::DeviceType type;
};

// `steps` steps of the loop LibTorch users write: zero_grad(), the loss `loss_of(step)` made
// under fp16 autocast, scaler.scale(loss).backward(), scaler.step() and update().
inline void amp_steps(int steps, torch::optim::Optimizer& optimizer, GradScaler& scaler,
                      const std::function<torch::Tensor(int)>& loss_of) {
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      HalfAutocast autocast;
      loss = loss_of(step);
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
  }
}

// The details of the events of `kind` in the run.db at `db`, in the order written.
inline std::vector<std::string> event_details(const std::string& db, const std::string& kind) {
  std::vector<std::string> details;
  for (const auto& e : rundb::RunDbReader(db).events())
    if (e.kind == kind) details.push_back(e.detail);
  return details;
}

// Agent options that write `db`, the rest as they come.
inline AgentOptions options_for(const std::string& db) {
  AgentOptions o;
  o.db_path = db;
  return o;
}

// `steps` fp16 steps (amp_steps) of `net` with SGD at `lr` and a GradScaler, an Agent on it
// writing `db`, closed on return: `loss_of(agent)` runs a step's forward and returns its loss.
inline void agent_steps(torch::nn::Module& net, const std::string& db, int steps, double lr,
                        const std::function<torch::Tensor(Agent&)>& loss_of) {
  torch::optim::SGD optimizer(net.parameters(), torch::optim::SGDOptions(lr));
  GradScaler scaler;
  Agent agent(net, scaler, options_for(db));
  amp_steps(steps, optimizer, scaler, [&](int) { return loss_of(agent); });
}

// agent_steps() on a fresh TinyNet (seed 0, SGD at 1e-4): `loss_of(agent, net)`.
inline void tiny_agent_steps(const std::string& db, int steps,
                             const std::function<torch::Tensor(Agent&, TinyNet&)>& loss_of) {
  torch::manual_seed(0);
  TinyNet net;
  agent_steps(*net, db, steps, 1e-4, [&](Agent& agent) { return loss_of(agent, net); });
}

// A recorded histogram has run.db's bins and counts exactly the row's finite non-zero values.
inline bool counts_finite_nonzero(const std::vector<std::uint32_t>& histogram, const rundb::StatValues& s) {
  std::int64_t sum = 0;
  for (const auto c : histogram) sum += c;
  return histogram.size() == std::size_t(rundb::kHistBins) && sum == s.numel - s.zeros - s.nan - s.inf;
}

struct TrainResult {
  std::vector<torch::Tensor> params;  // on the host
  std::int64_t skipped = 0;
  std::vector<double> losses, scales;  // per step: the loss, the scale after update()
};

// Trains `steps` steps on `device`; `make_agent` (may be empty) attaches an agent to the
// model and scaler and returns it; the forward calls agent.probe. `around_step` (may be
// empty) wraps the forward and the scaler calls but step(): the CUDA tests run them with
// torch's sync debug mode set to error. Losses and scales stay on the device until the end.
inline TrainResult train_tiny(std::int64_t steps,
                              const std::function<std::unique_ptr<Agent>(TinyNet&, GradScaler&)>& make_agent,
                              c10::Device device = c10::kCPU,
                              const std::function<void(const std::function<void()>&)>& around_step = nullptr) {
  torch::manual_seed(0);
  TinyNet net;
  net->to(device);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  GradScalerOptions options;
  options.init_scale = 1e9;  // far too high: the first steps overflow in fp16 and are skipped
  options.growth_interval = 4;
  GradScaler scaler(options);
  std::unique_ptr<Agent> agent = make_agent ? make_agent(net, scaler) : nullptr;
  const auto x = torch::randn({64, 16}).to(device);
  const auto y = torch::randn({64, 1}).to(device);
  TrainResult result;
  std::vector<torch::Tensor> losses, scales;
  const auto run = [&](const std::function<void()>& f) { around_step ? around_step(f) : f(); };
  for (std::int64_t step = 0; step < steps; ++step) {
    torch::Tensor loss;
    run([&] {
      optimizer.zero_grad();
      HalfAutocast autocast(device.type());
      auto h = torch::relu(net->a(x));
      if (agent) h = agent->probe("a", h);
      h = torch::relu(net->b(h));
      if (agent) h = agent->probe("b", h);
      loss = torch::mse_loss(net->c(h).to(torch::kFloat), y);
    });
    run([&] {
      scaler.scale(loss).backward();
      scaler.unscale_(optimizer);
    });
    scaler.step(optimizer);  // reads found_inf to decide, as torch's scaler does
    run([&] { scaler.update(); });
    result.skipped += scaler.last_step_skipped() ? 1 : 0;
    losses.push_back(loss.detach().to(torch::kDouble));
    scales.push_back(scaler.scale_tensor().to(torch::kDouble));
  }
  for (const auto& l : losses) result.losses.push_back(l.item<double>());
  for (const auto& s : scales) result.scales.push_back(s.item<double>());
  if (agent) agent->close();
  for (const auto& p : net->parameters()) result.params.push_back(p.detach().cpu().clone());
  return result;
}

// Same dtype, shape and bits: compared as integers of the element's width (a view as
// int32 of a bf16 tensor of odd length would raise).
inline bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto bits = a.element_size() == 2 ? torch::kShort : a.element_size() == 8 ? torch::kLong : torch::kInt;
  return a.view(bits).equal(b.view(bits));
}

}  // namespace ampdiag::test
