// The C++ agent and GradScaler on CUDA tensors: training is bit-identical with and without
// the agent, the run.db holds the losses and scales the scaler had (read back from the
// device a step late), and the forward, scale(), unscale_() and update() never make the
// host wait for the device (torch's sync debug mode set to error stays silent). Without a
// CUDA device this binary says why and exits 77, which ctest reports as skipped.
#define CATCH_CONFIG_RUNNER
#include "../catch_with_torch.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../agent/src/device_reads.h"
#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"
#include "half_training.h"
#include "no_scaler_training.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

const c10::Device kCuda(c10::kCUDA, 0);

std::function<std::unique_ptr<Agent>(TinyNet&, GradScaler&)> attach(const std::string& db, bool histogram = false) {
  return [db, histogram](TinyNet& net, GradScaler& scaler) {
    AgentOptions o;
    o.db_path = db;
    o.histogram = histogram;
    return std::make_unique<Agent>(*net, scaler, o);
  };
}

// Runs f with every host synchronisation torch makes turned into an error.
void without_syncs(const std::function<void()>& f) {
  auto& state = c10::cuda::warning_state();
  const auto before = state.get_sync_debug_mode();
  state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    f();
  } catch (...) {
    state.set_sync_debug_mode(before);
    throw;
  }
  state.set_sync_debug_mode(before);
}

}  // namespace

TEST_CASE("CUDA training with the agent gives bit-identical parameters", "[cuda]") {
  TempDir dir;
  const auto without = train_tiny(30, nullptr, kCuda);
  REQUIRE(without.skipped > 0);
  const auto with = train_tiny(30, attach(dir.file("run.db")), kCuda);
  CHECK(with.skipped == without.skipped);
  REQUIRE(with.params.size() == without.params.size());
  for (std::size_t i = 0; i < with.params.size(); ++i) CHECK(bitwise_equal(with.params[i], without.params[i]));
}

TEST_CASE("forward, scale, unscale_ and update make no host sync on CUDA with the agent attached", "[cuda]") {
  TempDir dir;
  CHECK_NOTHROW(train_tiny(12, attach(dir.file("run.db")), kCuda, without_syncs));
}

TEST_CASE("CUDA weights' norms are read on the device and recorded at the steps their forwards used", "[cuda]") {
  // Reduced there, copied to pinned memory without a sync (update() of a skipped step reads
  // them too), recorded once landed, the last at close().
  TempDir dir;
  CHECK_NOTHROW(train_tiny(12, attach(dir.file("run.db")), kCuda, without_syncs));
  std::set<std::int64_t> steps;
  for (const auto& w : rundb::RunDbReader(dir.file("run.db")).weight_norms()) {
    CHECK(w.l2 > 0.0);
    steps.insert(w.step);
  }
  CHECK(steps.count(0) == 1);
  CHECK(steps.count(4) == 1);
  CHECK(steps.count(8) == 1);
}

TEST_CASE("a CUDA run.db holds each step's loss and scales, read back from the device", "[cuda]") {
  TempDir dir;
  const auto result = train_tiny(12, attach(dir.file("run.db")), kCuda);
  rundb::RunDbReader r(dir.file("run.db"));
  const auto steps = r.steps();
  REQUIRE(steps.size() == 12);
  CHECK(r.meta()["dropped_steps"] == "0");
  for (std::size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i);
    CHECK(steps[i].losses == 1);
    CHECK(steps[i].loss == float(result.losses[i]));  // the loss is float32; summed in double
    CHECK(steps[i].scale_after == result.scales[i]);
    CHECK(steps[i].found_inf == steps[i].skipped);
    if (i > 0) CHECK(steps[i].scale_before == steps[i - 1].scale_after);
  }
  CHECK(steps[0].scale_before == 1e9f);
}

TEST_CASE("CUDA gradients and probes are recorded from the device engine", "[cuda]") {
  TempDir dir;
  train_tiny(6, attach(dir.file("run.db")), kCuda);
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK(r.grad_stats().size() == 6 * 6);  // 3 Linear layers x (weight, bias) x 6 steps
  CHECK(r.act_stats().size() == 6 * 2);   // probes a and b
  for (const auto& e : r.events()) CHECK(e.kind != "slow-path");  // nothing went through a copy
}

TEST_CASE("with histograms on, CUDA gradients and probes carry histograms of their finite non-zero values", "[cuda]") {
  TempDir dir;
  train_tiny(6, attach(dir.file("run.db"), true), kCuda);
  rundb::RunDbReader r(dir.file("run.db"));
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 6 * 2);
  for (const auto& a : acts) REQUIRE(counts_finite_nonzero(a.histogram, a.stats));
  for (const auto& g : r.grad_stats()) REQUIRE(counts_finite_nonzero(g.histogram, g.stats));
}

TEST_CASE("stalled updates of bf16 CUDA parameters are counted on the device as a direct comparison counts them", "[cuda]") {
  // Reduced there and read back through pinned memory once landed, the last at close().
  // The direct run goes without the scaler, whose CUDA unscale is torch's (no bf16 kernel).
  TempDir dir;
  std::vector<UpdateRow> direct;
  const auto plain = train_half("", &direct, kCuda, /*scaler_enabled=*/false);
  const auto watched = train_half(dir.file("half.db"), nullptr, kCuda);
  REQUIRE(plain.size() == watched.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(bitwise_equal(plain[i], watched[i]));
  const auto recorded = recorded_updates(dir.file("half.db"));
  CHECK(recorded == sampled(direct));
  CHECK(mostly_stalled(recorded));
  for (const auto& e : rundb::RunDbReader(dir.file("half.db")).events()) CHECK(e.kind != "warning");
}

namespace {

NoScalerLoop on_cuda(const std::string& db) {
  NoScalerLoop loop;
  loop.steps = 8;
  loop.db = db;
  loop.device = kCuda;
  return loop;
}

}  // namespace

TEST_CASE("without a scaler, CUDA training with the agent is bit-identical and records every step", "[cuda]") {
  TempDir dir;
  const auto plain = train_without_scaler(on_cuda(""));
  const auto watched = train_without_scaler(on_cuda(dir.file("run.db")));
  REQUIRE(plain.size() == watched.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(bitwise_equal(plain[i], watched[i]));
  const auto steps = rundb::RunDbReader(dir.file("run.db")).steps();
  REQUIRE(steps.size() == 8);
  for (const auto& s : steps) {
    CHECK(s.scale_after == 1.0);
    CHECK(std::isfinite(s.loss));  // summed on the device, read back with the step's outcome
  }
}

TEST_CASE("without a scaler, the forward, loss() and step() make no host sync on CUDA", "[cuda]") {
  TempDir dir;
  NoScalerLoop loop = on_cuda(dir.file("run.db"));
  loop.around = without_syncs;
  CHECK_NOTHROW(train_without_scaler(loop));
}

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}

TEST_CASE("a device read whose hand-on throws is not handed on again, and the ones after it are kept", "[cuda]") {
  std::vector<std::int64_t> got;
  agent::DeviceReads reads([&](std::int64_t step, const std::vector<std::int64_t>&, const at::Tensor&) {
    if (step == 0) throw std::runtime_error("the writer is closed");
    got.push_back(step);
  });
  for (std::int64_t step = 0; step < 3; ++step) reads.send(step, {0}, torch::ones({4}, kCuda));
  CHECK_THROWS_WITH(reads.poll(true), "the writer is closed");
  CHECK(got.empty());
  reads.poll(true);
  CHECK(got == std::vector<std::int64_t>{1, 2});
}
