// ampdiag::GradScaler against the real torch.amp.GradScaler: the trajectory recorded by
// gradscaler_trajectory.py (run by ctest as a fixture) is replayed step for step.
#include "../catch_with_torch.h"

#include <cmath>

#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "ampdiag/grad_scaler.h"

#ifndef AMPDIAG_TRAJECTORY_CSV
#error "AMPDIAG_TRAJECTORY_CSV must name the fixture file"
#endif

namespace {

// Same formula as grad_values() in gradscaler_trajectory.py.
std::vector<float> grad_values(int step) {
  const float base = float(step % 5 + 1) * 0.25f;
  std::vector<float> v = {base, -base * 0.5f, base * 3.0f, 1e-3f};
  for (int s : {3, 4, 5, 11, 25})
    if (step == s) v[1] = std::numeric_limits<float>::infinity();
  for (int s : {7, 20, 26})
    if (step == s) v[2] = std::numeric_limits<float>::quiet_NaN();
  return v;
}

std::string bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", u);
  return buf;
}

struct Row {
  int step;
  double scale_before, scale_after;
  bool skipped;
  std::int64_t growth_tracker;
  std::vector<std::string> params;
};

std::vector<Row> load_fixture() {
  std::ifstream in(AMPDIAG_TRAJECTORY_CSV);
  REQUIRE(in.good());
  std::string line;
  std::getline(in, line);  // header
  std::vector<Row> rows;
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string field;
    std::vector<std::string> f;
    while (std::getline(ss, field, ',')) f.push_back(field);
    REQUIRE(f.size() == 9);
    rows.push_back({std::stoi(f[0]), std::stod(f[1]), std::stod(f[3]), f[2] == "1", std::stoll(f[4]),
                    {f[5], f[6], f[7], f[8]}});
  }
  return rows;
}

}  // namespace

TEST_CASE("GradScaler follows torch.amp.GradScaler step for step", "[scaler][torch]") {
  const auto rows = load_fixture();
  REQUIRE(rows.size() == 40);
  auto param = torch::zeros({4}).set_requires_grad(true);
  torch::optim::SGD optimizer({param}, torch::optim::SGDOptions(0.5));
  ampdiag::GradScalerOptions options;
  options.init_scale = 1024.0;
  options.growth_interval = 3;
  ampdiag::GradScaler scaler(options);
  for (const Row& want : rows) {
    INFO("step " << want.step);
    optimizer.zero_grad();
    scaler.scale(torch::ones({}));
    const double scale_before = scaler.get_scale();
    CHECK(scale_before == want.scale_before);
    param.mutable_grad() = torch::tensor(grad_values(want.step)) * scale_before;
    scaler.step(optimizer);
    CHECK(scaler.last_step_skipped() == want.skipped);
    scaler.update();
    CHECK(scaler.get_scale() == want.scale_after);
    CHECK(scaler.growth_tracker() == want.growth_tracker);
    for (int i = 0; i < 4; ++i) CHECK(bits(param[i].item<float>()) == want.params[std::size_t(i)]);
  }
}

TEST_CASE("GradScaler state survives a save and load", "[scaler]") {
  ampdiag::GradScaler a;
  a.scale(torch::ones({}));
  auto state = a.state_dict();
  state.scale = 512.0;
  state.growth_tracker = 7;
  ampdiag::GradScaler b;
  b.load_state_dict(state);
  CHECK(b.get_scale() == 512.0);
  CHECK(b.growth_tracker() == 7);
  b.scale(torch::ones({}));  // the lazily created tensors start from the loaded state
  CHECK(b.get_scale() == 512.0);
  CHECK(b.growth_tracker() == 7);
}

TEST_CASE("GradScaler rejects the misuse torch rejects", "[scaler]") {
  CHECK_THROWS_WITH(ampdiag::GradScaler({65536.0, 1.0}), Catch::Contains("growth factor must be > 1.0"));
  CHECK_THROWS_WITH(ampdiag::GradScaler({65536.0, 2.0, 1.5}), Catch::Contains("backoff factor must be < 1.0"));
  auto param = torch::zeros({2}).set_requires_grad(true);
  torch::optim::SGD optimizer({param}, torch::optim::SGDOptions(0.1));
  ampdiag::GradScaler scaler;
  CHECK_THROWS_WITH(scaler.step(optimizer), Catch::Contains("scale(loss)"));
  scaler.scale(torch::ones({}));
  param.mutable_grad() = torch::ones({2});
  scaler.unscale_(optimizer);
  CHECK_THROWS_WITH(scaler.unscale_(optimizer), Catch::Contains("already been called"));
  scaler.step(optimizer);
  CHECK_THROWS_WITH(scaler.step(optimizer), Catch::Contains("already been called"));
  param.mutable_grad() = torch::ones({2}, torch::kHalf);
  scaler.update();
  CHECK_THROWS_WITH(scaler.unscale_(optimizer), Catch::Contains("FP16 gradients"));
}

TEST_CASE("update(new_scale) refuses a scale that is not a finite positive number", "[scaler]") {
  ampdiag::GradScaler scaler;
  scaler.scale(torch::ones({}));
  for (double bad : {0.0, -1.0, std::nan(""), double(INFINITY)})
    CHECK_THROWS_WITH(scaler.update(bad), Catch::Contains("new_scale must be a finite number > 0"));
  CHECK(scaler.get_scale() == 65536.0);  // nothing changed
  scaler.update(128.0);
  CHECK(scaler.get_scale() == 128.0);
}

// Records what the scaler hands its observer at each update().
struct UpdateLog final : ampdiag::ScalerObserver {
  std::vector<ampdiag::ScaleUpdate> updates;
  void on_scale(const at::Tensor&) override {}
  bool on_unscale(ampdiag::UnscaleBatch&) override { return false; }
  void on_step(bool) override {}
  void on_update(const ampdiag::ScaleUpdate& u) override { updates.push_back(u); }
};

TEST_CASE("the observer gets the update as tensors: the scale before, a copy of the scale after, found_inf", "[scaler]") {
  auto param = torch::zeros({2}).set_requires_grad(true);
  torch::optim::SGD optimizer({param}, torch::optim::SGDOptions(0.1));
  ampdiag::GradScaler scaler;
  UpdateLog log;
  scaler.set_observer(&log);
  scaler.scale(torch::ones({}));
  param.mutable_grad() = torch::full({2}, INFINITY);
  scaler.step(optimizer);
  scaler.update();   // backs off: 65536 -> 32768
  scaler.update(8.0);  // no checks since: found_inf undefined
  REQUIRE(log.updates.size() == 2);
  CHECK(log.updates[0].scale_before.item<double>() == 65536.0);
  CHECK(log.updates[0].scale_after.item<double>() == 32768.0);  // a copy: the later update(8) left it alone
  CHECK(log.updates[0].found_inf.item<float>() == 1.0f);
  CHECK(log.updates[1].scale_before.item<double>() == 32768.0);
  CHECK(log.updates[1].scale_after.item<double>() == 8.0);
  CHECK_FALSE(log.updates[1].found_inf.defined());
  scaler.set_observer(nullptr);
}

TEST_CASE("a disabled GradScaler only steps the optimizer", "[scaler]") {
  auto param = torch::zeros({2}).set_requires_grad(true);
  torch::optim::SGD optimizer({param}, torch::optim::SGDOptions(1.0));
  ampdiag::GradScalerOptions options;
  options.enabled = false;
  ampdiag::GradScaler scaler(options);
  auto loss = torch::ones({});
  CHECK(scaler.scale(loss).equal(loss));
  param.mutable_grad() = torch::ones({2});
  CHECK(scaler.step(optimizer));
  scaler.update();
  CHECK(scaler.get_scale() == 1.0);
  CHECK(param[0].item<float>() == -1.0f);
}
