// The agent attached to a real fp16-autocast training loop: it changes no number, and it
// records what happened in the order it happened.
#include "../catch_with_torch.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_setup.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

std::function<std::unique_ptr<Agent>(TinyNet&, GradScaler&)> attach(const std::string& db, bool fused,
                                                                     std::int64_t activation_every = 10,
                                                                     bool histogram = false) {
  return [=](TinyNet& net, GradScaler& scaler) {
    AgentOptions o;
    o.db_path = db;
    o.fused_unscale = fused;
    o.activation_every = activation_every;
    o.histogram = histogram;
    return std::make_unique<Agent>(*net, scaler, o);
  };
}

}  // namespace

TEST_CASE("training with the agent gives bit-identical parameters, fused unscale or not", "[agent]") {
  TempDir dir;
  const auto without = train_tiny(30, nullptr);
  REQUIRE(without.skipped > 0);  // the comparison covers skipped steps too
  for (bool fused : {true, false}) {
    INFO("fused unscale " << fused);
    const auto with = train_tiny(30, attach(dir.file(fused ? "fused.db" : "plain.db"), fused));
    CHECK(with.skipped == without.skipped);
    REQUIRE(with.params.size() == without.params.size());
    for (std::size_t i = 0; i < with.params.size(); ++i) CHECK(bitwise_equal(with.params[i], without.params[i]));
  }
}

TEST_CASE("every step is recorded with its loss scale and whether it was skipped", "[agent]") {
  TempDir dir;
  const auto result = train_tiny(12, attach(dir.file("run.db"), true));
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK(r.finished());
  const auto steps = r.steps();
  REQUIRE(steps.size() == 12);
  std::int64_t skipped = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    CHECK(steps[i].step == std::int64_t(i));
    CHECK(std::isfinite(steps[i].loss));
    if (steps[i].skipped) {
      ++skipped;
      CHECK(steps[i].scale_after == steps[i].scale_before * 0.5);
    }
    if (i > 0) CHECK(steps[i].scale_before == steps[i - 1].scale_after);
    CHECK(steps[i].agent_ns > 0);
  }
  CHECK(skipped == result.skipped);
  CHECK(steps[0].scale_before == 1e9);
}

TEST_CASE("gradient statistics are taken before unscale and name the overflowing layers", "[agent]") {
  TempDir dir;
  train_tiny(3, attach(dir.file("run.db"), true));
  rundb::RunDbReader r(dir.file("run.db"));
  const auto layers = r.layers();
  REQUIRE(layers.size() == 6);
  CHECK(layers[0].name == "a.weight");
  CHECK(layers[0].module_path == "a");
  CHECK(layers[0].module_type == "Linear");
  CHECK(layers[0].shape == "[32, 16]");
  const auto grads = r.grad_stats();
  REQUIRE(grads.size() == 3 * 6);
  std::int64_t nonfinite_step0 = 0;
  for (const auto& g : grads)
    if (g.step == 0) nonfinite_step0 += g.stats.nan + g.stats.inf;
  CHECK(nonfinite_step0 > 0);  // at a scale of 1e9 the fp16 backward overflows
}

TEST_CASE("bwd_order is the order in which gradients arrive in backward", "[agent]") {
  TempDir dir;
  train_tiny(1, attach(dir.file("run.db"), true));
  rundb::RunDbReader r(dir.file("run.db"));
  std::map<std::string, std::int64_t> order;
  const auto layers = r.layers();
  for (const auto& g : r.grad_stats()) order[layers[std::size_t(g.layer_id)].module_path] = std::max(order[layers[std::size_t(g.layer_id)].module_path], g.bwd_order);
  // Backward runs from the loss: c's gradients arrive first, a's last.
  CHECK(order["c"] < order["b"]);
  CHECK(order["b"] < order["a"]);
}

TEST_CASE("probes record activation statistics in forward order and return their input", "[agent]") {
  TempDir dir;
  train_tiny(2, attach(dir.file("run.db"), true, 1));
  rundb::RunDbReader r(dir.file("run.db"));
  const auto modules = r.modules();
  REQUIRE(modules.size() == 2);
  CHECK(modules[0].path == "a");
  CHECK(modules[0].module_type == "Linear");
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 4);
  CHECK(acts[0].fwd_order == 0);
  CHECK(acts[1].fwd_order == 1);
  CHECK(acts[0].stats.numel == 64 * 32);
  CHECK(acts[0].stats.zeros > 0);  // relu output
}

TEST_CASE("with histograms on, gradients and probes carry histograms of their finite non-zero values", "[agent]") {
  TempDir dir;
  train_tiny(6, attach(dir.file("run.db"), true, 1, true));
  rundb::RunDbReader r(dir.file("run.db"));
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 6 * 2);
  for (const auto& a : acts) REQUIRE(counts_finite_nonzero(a.histogram, a.stats));
  const auto grads = r.grad_stats();
  REQUIRE(grads.size() == 6 * 6);
  for (const auto& g : grads) REQUIRE(counts_finite_nonzero(g.histogram, g.stats));
}

TEST_CASE("finite probes get full statistics on one recorded step in activation_every, and no row between",
          "[agent]") {
  TempDir dir;
  train_tiny(12, attach(dir.file("run.db"), true, 5));
  rundb::RunDbReader r(dir.file("run.db"));
  REQUIRE(r.meta().at("activation_every") == "5");
  std::vector<std::int64_t> steps;
  for (const auto& a : r.act_stats()) steps.push_back(a.step);
  const std::vector<std::int64_t> want = {0, 0, 5, 5, 10, 10};  // probes a and b; the forward stays finite
  REQUIRE(steps == want);
}

TEST_CASE("sampling every N steps still records overflowing steps and their neighbours", "[agent]") {
  TempDir dir;
  const auto db = dir.file("sparse.db");
  train_tiny(40, [db](TinyNet& net, GradScaler& scaler) {
    AgentOptions o;
    o.db_path = db;
    o.every = 1000;
    o.context_steps = 1;
    return std::make_unique<Agent>(*net, scaler, o);
  });
  rundb::RunDbReader r(db);
  std::set<std::int64_t> with_stats;
  for (const auto& g : r.grad_stats()) with_stats.insert(g.step);
  for (const auto& s : r.steps()) {
    INFO("step " << s.step);
    if (s.skipped || s.scale_after != s.scale_before) {
      CHECK(with_stats.count(s.step) == 1);
      CHECK(s.sampled);
    }
    CHECK(s.sampled == (with_stats.count(s.step) == 1));
  }
  CHECK(with_stats.size() < 40);  // and not every step
}

TEST_CASE("an extra update(new_scale) is the same step, and the step's loss sums its scale() calls", "[agent]") {
  TempDir dir;
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = dir.file("run.db");
  std::vector<double> losses;
  {
    Agent agent(*net, scaler, o);
    const auto x = torch::randn({8, 16});
    for (int step = 0; step < 5; ++step) {
      optimizer.zero_grad();
      double total = 0.0;
      for (int micro = 0; micro < 2; ++micro) {  // gradient accumulation: two scale() calls
        torch::Tensor loss;
        {
          HalfAutocast autocast;
          loss = net->c(torch::relu(net->b(torch::relu(net->a(x))))).to(torch::kFloat).pow(2).mean() / 2;
        }
        scaler.scale(loss).backward();
        total += loss.item<double>();
      }
      scaler.step(optimizer);
      scaler.update();
      scaler.update(1024.0);  // holding the scale: no gradients checked since the last update()
      losses.push_back(total);
    }
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto steps = r.steps();
  REQUIRE(steps.size() == 5);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    CHECK(steps[i].scale_after == 1024.0);
    CHECK(steps[i].losses == 2);
    CHECK(steps[i].loss == Approx(losses[i]).epsilon(1e-6));
  }
}

TEST_CASE("a non-scalar passed to scale() is no loss: the step's loss is not NaN", "[agent]") {
  TinySetup t;
  auto& [dir, net, optimizer, scaler, o] = t;
  {
    Agent agent(*net, scaler, o);
    const auto x = torch::randn({8, 16});
    optimizer.zero_grad();
    torch::Tensor per_sample;
    {
      HalfAutocast autocast;
      per_sample = net->c(torch::relu(net->b(torch::relu(net->a(x))))).to(torch::kFloat).squeeze(1);
    }
    scaler.scale(per_sample).backward(torch::full_like(per_sample, 1.0 / 8));  // a vector "loss"
    scaler.step(optimizer);
    scaler.update();
  }
  const auto steps = rundb::RunDbReader(dir.file("run.db")).steps();
  REQUIRE(steps.size() == 1);
  CHECK(steps[0].losses == 0);
}

TEST_CASE("a float16 loss passed to scale() is one half-loss event", "[agent]") {
  TinySetup t;
  train_with_agent(t, 3, at::kHalf, [&](Agent&, int) {
    auto loss = t.net->c(torch::relu(t.net->b(torch::relu(t.net->a(torch::randn({8, 16})))))).mean();  // stays fp16
    REQUIRE(loss.scalar_type() == torch::kHalf);
    return loss;
  });
  CHECK(events_of(t, "half-loss").size() == 1);
}

namespace {

// Three steps whose forward takes `batch_of(step)` through agent.input() and probes a, b
// and c; the run's "input-nan" events as (step, detail).
std::vector<std::pair<std::int64_t, std::string>> input_nan_events(const std::function<torch::Tensor(int)>& batch_of) {
  TinySetup t;
  train_with_agent(t, 3, at::kHalf, [&](Agent& agent, int step) {
    const auto x = agent.input("x", batch_of(step));
    const auto h = agent.probe("b", t.net->b(torch::relu(agent.probe("a", t.net->a(x)))));
    return agent.probe("c", t.net->c(torch::relu(h))).to(torch::kFloat).pow(2).mean();
  });
  return events_of(t, "input-nan");
}

}  // namespace

TEST_CASE("a NaN in the batch given to input() is the data's: one input-nan event in its step", "[agent]") {
  const auto events = input_nan_events([](int step) {
    auto x = torch::randn({8, 16});
    if (step == 1) x[3][7] = std::nan("");
    return x;
  });
  REQUIRE(events.size() == 1);
  CHECK(events[0].first == 1);
  CHECK(events[0].second == "x (float32 [8, 16]): 1 NaN of 128 values");
}

TEST_CASE("a -inf in the batch given to input() and only probed is not called a corruption", "[agent]") {
  // An additive mask passed in: its -inf turns the outputs NaN/Inf, and it is no bad data.
  const auto events = input_nan_events([](int step) {
    auto x = torch::randn({8, 16});
    if (step == 1) x[3][7] = -std::numeric_limits<float>::infinity();
    return x;
  });
  CHECK(events.empty());
}

TEST_CASE("a sparse tensor given to input() is passed over when the step goes NaN/Inf", "[agent]") {
  // Its values are not read as a dense tensor's (masked_select refuses a sparse one).
  TinySetup t;
  train_with_agent(t, 2, at::kHalf, [&](Agent& agent, int) {
    agent.input("features", torch::sparse_coo_tensor(torch::tensor({{0, 2}}), torch::tensor({INFINITY, 1e6f}), {4}));
    const auto x = agent.input("x", torch::randn({8, 16}) * 1.0e6);  // a's fp16 cast overflows
    return agent.probe("a", t.net->a(x)).to(torch::kFloat).mean();
  });
  CHECK(events_of(t, "input-nan").empty());
}

namespace {

// A batch of normal values, with `value` at [row][col] in step 1.
std::function<torch::Tensor(int)> batch_with(float value, int row = 3, int col = 7) {
  return [=](int step) {
    auto x = torch::randn({8, 16});
    if (step == 1) x[row][col] = value;
    return x;
  };
}

// Three steps whose forward runs a, b and c through agent.forward() (a first NaN/Inf output
// is replayed in FP32) on `batch_of(step)` given to input(); returns the run's events of
// `kind` and sets `replays` to the number of replays recorded.
std::vector<std::pair<std::int64_t, std::string>> replayed_forward(TinySetup& t,
                                                                   const std::function<torch::Tensor(int)>& batch_of,
                                                                   const std::string& kind, std::size_t& replays) {
  train_with_agent(t, 3, at::kHalf, [&](Agent& agent, int step) {
    const auto x = agent.input("x", batch_of(step));
    const auto h = agent.forward("b", t.net->b, torch::relu(agent.forward("a", t.net->a, x)));
    return agent.forward("c", t.net->c, torch::relu(h)).to(torch::kFloat).pow(2).mean();
  });
  replays = rundb::RunDbReader(t.dir.file("run.db")).replays().size();
  return events_of(t, kind);
}

}  // namespace

TEST_CASE("NaN weights the model came with are one parameters-nonfinite event naming them, and no replay", "[agent]") {
  TinySetup t;
  {
    torch::NoGradGuard no_grad;
    t.net->b->weight[2][3] = std::nan("");  // a checkpoint saved after its run diverged
  }
  std::size_t replays = 1;
  const auto events = replayed_forward(t, [](int) { return torch::randn({8, 16}); }, "parameters-nonfinite", replays);
  REQUIRE(events.size() == 1);
  CHECK(events[0].first == 0);
  CHECK(events[0].second == "1 of 6 parameter tensors: b.weight");
  CHECK(replays == 0);  // b's FP32 replay would have called its NaN weights its own code
}

TEST_CASE("a frozen -inf mask kept as a parameter is not NaN/Inf weights: the module is still replayed", "[agent]") {
  TinySetup t;
  t.net->register_parameter("mask", torch::full({4, 4}, -std::numeric_limits<float>::infinity()).triu(1),
                            /*requires_grad=*/false);
  std::size_t replays = 0;
  const auto events = replayed_forward(
      t,
      batch_with(1.0e6, 0, 0),  // finite: a's fp16 cast overflows, a replay is spent
      "parameters-nonfinite", replays);
  CHECK(events.empty());
  CHECK(replays == 1);
}

TEST_CASE("a NaN batch given to input() spends no replay on the module that received it", "[agent]") {
  TinySetup t;
  std::size_t replays = 1;
  const auto events = replayed_forward(
      t,
      batch_with(std::nan(""), 0, 0),
      "input-nan", replays);
  CHECK(events.size() == 1);
  CHECK(replays == 0);
  CHECK(events_of(t, "parameters-nonfinite").empty());  // the weights are finite: not looked at as NaN
}

TEST_CASE("a -inf in the batch given to input() that a module run through forward() receives is the data's",
          "[agent]") {
  // A log power of 0 in preprocessing, fed to a Linear.
  TinySetup t;
  std::size_t replays = 1;
  const auto events = replayed_forward(
      t,
      batch_with(-std::numeric_limits<float>::infinity(), 3, 7),
      "input-nan", replays);
  REQUIRE(events.size() == 1);
  CHECK(events[0].second == "x (float32 [8, 16]): 1 -Inf of 128 values");
  CHECK(replays == 0);
}

TEST_CASE("a batch beyond fp16's range given to input() is named where the first module's replay was finite",
          "[agent]") {
  // A raw feature (a price in currency units): autocast's cast to fp16 makes it Inf in a.
  TinySetup t;
  std::size_t replays = 0;
  const auto events = replayed_forward(
      t,
      batch_with(1.0e5, 2, 5),
      "input-beyond-fp16", replays);
  REQUIRE(events.size() == 1);
  CHECK(events[0].first == 1);
  CHECK(events[0].second == "a: input (float32 [8, 16]): 1 of 128 values at or beyond 65520, max |x| 100000; the "
                            "model's input");
  CHECK(replays == 1);
}

TEST_CASE("a module run through forward() on a view of the last module's output is recorded as given it",
          "[agent]") {
  // overflow-origin reads it to name the module whose backward sends a gradient back.
  TinySetup t;
  train_with_agent(t, 2, at::kHalf, [&](Agent& agent, int) {
    const auto x = agent.input("x", torch::randn({8, 16}));
    const auto h = agent.forward("b", t.net->b, agent.forward("a", t.net->a, x).view({8, 32}));  // a view of a's output
    return agent.forward("c", t.net->c, torch::relu(h)).to(torch::kFloat).pow(2).mean();  // after a relu: not
  });
  const auto events = events_of(t, "module-input-from");
  REQUIRE(events.size() == 1);
  CHECK(events[0].second == "b: a");
}

TEST_CASE("an input whose values beyond fp16's range are one negative fill is a mask, not data", "[agent]") {
  // float32's lowest in two places, as an additive mask holds it: a's replay is finite, and
  // the look names nothing.
  TinySetup t;
  std::size_t replays = 0;
  const auto lowest = std::numeric_limits<float>::lowest();
  const auto events = replayed_forward(
      t,
      [=](int step) {
        auto x = torch::randn({8, 16});
        if (step == 1) x[3][7] = x[5][2] = lowest;
        return x;
      },
      "input-beyond-fp16", replays);
  CHECK(events.empty());
  CHECK(replays == 1);
}

TEST_CASE("values beyond fp16's range made by the model's float32 code are the module's input, not the model's",
          "[agent]") {
  TinySetup t;
  train_with_agent(t, 2, at::kHalf, [&](Agent& agent, int) {
    const auto x = agent.input("x", torch::randn({8, 16}));
    const auto h = torch::relu(agent.forward("a", t.net->a, x)).to(torch::kFloat) * 1.0e6;  // float32 code
    return agent.forward("b", t.net->b, h).to(torch::kFloat).pow(2).mean();
  });
  const auto events = events_of(t, "input-beyond-fp16");
  REQUIRE(events.size() == 1);
  CHECK_THAT(events[0].second, Catch::StartsWith("b: input (float32 [8, 32]): "));
  CHECK_THAT(events[0].second, !Catch::EndsWith("; the model's input"));
}

TEST_CASE("a batch within fp16's range is no input-beyond-fp16, though its module overflows", "[agent]") {
  TinySetup t;
  train_with_agent(t, 2, at::kHalf, [&](Agent& agent, int) {
    const auto x = agent.input("x", torch::randn({8, 16}) * 1000.0);  // each value in range, a's sums are not
    {
      torch::NoGradGuard no_grad;
      t.net->a->weight.fill_(100.0);
    }
    return agent.forward("a", t.net->a, x).to(torch::kFloat).pow(2).mean();
  });
  CHECK(events_of(t, "input-beyond-fp16").empty());
  CHECK(rundb::RunDbReader(t.dir.file("run.db")).replays().size() == 1);
}

TEST_CASE("profiling that cannot start is one event, and training is bit-identical", "[agent][profile]") {
  TempDir dir;
  const auto db = dir.file("profiled.db");
  const auto without = train_tiny(12, nullptr);
  const auto with = train_tiny(12, [&](TinyNet& net, GradScaler& scaler) {
    AgentOptions o;
    o.db_path = db;
    o.profile = true;
    auto agent = std::make_unique<Agent>(*net, scaler, o);
    { auto range = agent->module_range("a"); }  // not profiling: a guard that does nothing
    return agent;
  });
  for (std::size_t i = 0; i < with.params.size(); ++i) CHECK(bitwise_equal(with.params[i], without.params[i]));
  rundb::RunDbReader r(db);
  CHECK(r.steps().size() == 12);
  if (r.meta().at("profiler") != "unavailable") return;  // a machine with a GPU and CUPTI
  int events = 0;
  for (const auto& e : r.events()) events += e.kind == "profiler-unavailable";
  CHECK(events == 1);
  CHECK(r.gpu_time().empty());
}

#define AMPDIAG_STRING(...) #__VA_ARGS__
#define AMPDIAG_EXPANDED(...) AMPDIAG_STRING(__VA_ARGS__)

TEST_CASE("CHECK in a LibTorch test is Catch's, not c10's glog-style CHECK", "[agent]") {
  // c10's aborted on failure and was never counted (tests/catch_with_torch.h).
  const std::string expanded = AMPDIAG_EXPANDED(CHECK(true));
  CHECK_THAT(expanded, Catch::Contains("Catch::AssertionHandler"));
}

TEST_CASE("a module registered after the Agent was made is a layer under its own name, ordered from the next step",
          "[agent]") {
  TempDir dir;
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = dir.file("run.db");
  {
    Agent agent(*net, scaler, o);
    torch::nn::Linear extra{nullptr};
    const auto x = torch::randn({8, 16});
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {  // a block grown during training, given to the optimizer
        extra = net->register_module("extra", torch::nn::Linear(32, 32));
        optimizer.add_param_group(torch::optim::OptimizerParamGroup(extra->parameters()));
      }
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        HalfAutocast autocast;
        auto h = torch::relu(net->b(torch::relu(net->a(x))));
        if (extra) h = h + extra(h);
        loss = net->c(h).to(torch::kFloat).pow(2).mean();
      }
      scaler.scale(loss).backward();
      scaler.step(optimizer);
      scaler.update();
    }
  }
  rundb::RunDbReader r(dir.file("run.db"));
  std::map<std::int64_t, std::string> names;
  for (const auto& l : r.layers()) names[l.id] = l.name + "|" + l.module_path + "|" + l.module_type;
  REQUIRE(names.size() == 8);
  CHECK(names[6] == "extra.weight|extra|Linear");
  CHECK(names[7] == "extra.bias|extra|Linear");
  std::int64_t added = 0, foreign = 0;
  for (const auto& e : r.events()) {
    added += e.kind == "parameters-added";
    foreign += e.kind == "foreign-parameter";
  }
  CHECK(added == 2);
  CHECK(foreign == 0);
  for (const auto& g : r.grad_stats())
    if (g.layer_id >= 6) CHECK((g.step == 2 ? g.bwd_order < 0 : g.bwd_order >= 0));
}
