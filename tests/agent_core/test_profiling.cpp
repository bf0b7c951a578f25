// Device profiling through the session core, end to end: a synthetic activity source
// shaped like CUPTI (kernels by correlation id, external ids from the ranges pushed on
// the launching thread) -> the writer thread -> run.db's gpu_time -> the analyzer's
// device profile, the pin cost line in the report, and the degrade path.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/render.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/reader.h"
#include "session.h"
#include "../rundb/temp_dir.h"

using namespace ampdiag;
using rundb::GpuKind;
using rundb::GpuPhase;
using test::TempDir;

namespace {

// What the "device" ran: the test launches kernels; while recording, each gets the next
// correlation id and, inside a range, an external correlation with the innermost id.
struct SyntheticGpu {
  std::mutex mutex;
  std::vector<std::uint64_t> stack;
  bool recording = false, stopped = false;
  std::string refuse;  // start() fails with this
  std::uint32_t next_correlation = 1;
  std::uint64_t clock_ns = 1000;
  profiler::ActivityBatch pending;

  void launch(const std::string& name, std::uint64_t ns) {
    std::lock_guard<std::mutex> lock(mutex);
    const std::uint32_t c = next_correlation++;
    if (!recording) return;
    pending.kernels.push_back({name, clock_ns, clock_ns + ns, 0, 7, c});
    clock_ns += ns;
    if (!stack.empty()) pending.externals.push_back({c, stack.back()});
  }
};

struct SyntheticSource final : profiler::ActivitySource {
  std::shared_ptr<SyntheticGpu> gpu;
  explicit SyntheticSource(std::shared_ptr<SyntheticGpu> g) : gpu(std::move(g)) {}
  std::string start() override { return gpu->refuse; }
  void set_recording(bool on) override {
    std::lock_guard<std::mutex> lock(gpu->mutex);
    gpu->recording = on;
  }
  void push_range(std::uint64_t id) override {
    std::lock_guard<std::mutex> lock(gpu->mutex);
    gpu->stack.push_back(id);
  }
  void pop_range() override {
    std::lock_guard<std::mutex> lock(gpu->mutex);
    gpu->stack.pop_back();
  }
  void collect(profiler::ActivityBatch& out) override {
    std::lock_guard<std::mutex> lock(gpu->mutex);
    out.append(std::move(gpu->pending));
  }
  void stop() override {
    std::lock_guard<std::mutex> lock(gpu->mutex);
    gpu->stopped = true;
  }
  std::string name() const override { return "synthetic"; }
};

agent::SessionOptions profiled(const std::shared_ptr<SyntheticGpu>& gpu, std::int64_t every = 1) {
  agent::SessionOptions o;
  o.recorder.every = every;
  o.recorder.context_steps = 0;
  o.recorder.close_wait_ms = 0;
  o.cpu.threads = 1;
  o.profile = true;
  o.profiler_source = [gpu] { return std::make_unique<SyntheticSource>(gpu); };
  return o;
}

void open(agent::Session& s, const std::string& path) {
  agent::LayerInfo info;
  info.name = "encoder.0.weight";
  info.module_path = "encoder.0";
  info.dtype = "float32";
  info.numel = 8;
  s.add_layer(1000, info);
  s.layers_done();
  agent::RunMeta meta;
  meta.source = "test";
  meta.device = "cuda:0";
  meta.amp_dtype = "float16";
  s.write_meta(meta);
  s.open(path, {}, "test-run");
}

// One training step: encoder.0 runs fp16 GEMMs (forward and backward 400 ns each),
// encoder.1 is pinned and runs fp32 ones (forward 1200 ns: 3x per kernel), the loss runs
// outside every module, and ampdiag's statistics kernel 100 ns. `overflow`: encoder.0's
// output holds Inf.
void step(agent::Session& s, SyntheticGpu& gpu, std::int64_t enc0, std::int64_t enc1, bool overflow = false,
          std::uint64_t fp32_ns = 1200) {
  s.begin_cycle();
  if (s.begin_range(enc0, GpuPhase::kForward, GpuKind::kFloat16)) {
    gpu.launch("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", 400);
    s.end_range();
  }
  float out[4] = {1, 2, 3, overflow ? std::numeric_limits<float>::infinity() : 4};
  s.activation(enc0, {{out, 4, kernels::DType::kFloat32}, {}, nullptr}, 0);
  if (s.begin_range(enc1, GpuPhase::kForward, GpuKind::kFloat32)) {
    gpu.launch("ampere_sgemm_128x64_tn", fp32_ns);
    s.end_range();
  }
  gpu.launch("void at::native::mse_kernel<float>", 100);  // the step's own range: no module
  if (s.begin_range(enc0, GpuPhase::kBackward, GpuKind::kFloat16)) {
    gpu.launch("ampere_fp16_s16816gemm_fp16_64x64_tn", 400);
    s.end_range();
  }
  gpu.launch("void ampdiag::kernels::(anonymous namespace)::stats_kernel<true>(...)", 100);
  agent::StepOutcome o;
  o.loss = overflow ? std::nan("") : 1.0;
  o.losses = 1;
  o.scale_before = 65536;
  o.scale_after = overflow ? 32768 : 65536;
  o.found_inf = o.skipped = overflow;
  s.end_step(o, 0);
}

// What a test run varies: its steps, which one overflows (encoder.0's output holds Inf and
// its FP32 replay was finite), the second module, its fp32 kernels, the sampling.
struct Plan {
  int steps = 3;
  int overflow_at = -1;
  std::string second = "encoder.1", second_type = "Linear";
  std::uint64_t fp32_ns = 1200;
  std::int64_t every = 1;
};

// Runs the plan through a profiled session into `path`; `opened` sees the session once open.
void run_profiled(const std::string& path, const std::shared_ptr<SyntheticGpu>& gpu, const Plan& plan,
                  const std::function<void(agent::Session&)>& opened = nullptr) {
  agent::Session s(profiled(gpu, plan.every));
  open(s, path);
  if (opened) opened(s);
  const auto enc0 = s.module_id("encoder.0", "Linear", "", "float16");
  const auto second = s.module_id(plan.second, plan.second_type, "", "float32");
  for (int i = 0; i < plan.steps; ++i) step(s, *gpu, enc0, second, i == plan.overflow_at, plan.fp32_ns);
  if (plan.overflow_at >= 0) s.replay("encoder.0", "finite", 812.5, "");
  s.close();
}

// The cost line of the first fix the report gives for encoder.0.
std::string encoder0_pin_cost(const std::string& path) {
  const auto report = analyzer::analyze({analyzer::load_run(path)});
  for (const auto& f : report.findings)
    if (f.module == "encoder.0" && !f.suggestions.empty()) return f.suggestions.front().cost;
  return "";
}

}  // namespace

TEST_CASE("profiled steps write device time per module, phase and precision", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  auto gpu = std::make_shared<SyntheticGpu>();
  run_profiled(path, gpu, Plan{});
  CHECK(gpu->stopped);
  CHECK(gpu->stack.empty());  // every range pushed was popped
  const auto rows = rundb::RunDbReader(path).gpu_time();
  auto ns = [&](std::int64_t module, GpuPhase phase, GpuKind kind) {
    std::int64_t sum = 0;
    for (const auto& r : rows)
      if (r.module_id == module && r.phase == phase && r.kind == kind) sum += r.ns;
    return sum;
  };
  CHECK(ns(0, GpuPhase::kForward, GpuKind::kFloat16) == 3 * 400);
  CHECK(ns(0, GpuPhase::kBackward, GpuKind::kFloat16) == 3 * 400);
  CHECK(ns(1, GpuPhase::kForward, GpuKind::kFloat32) == 3 * 1200);
  CHECK(ns(-1, GpuPhase::kOther, GpuKind::kFloat32) == 3 * 100);
}

TEST_CASE("the report gives the precision split and a pin cost measured from comparable kernels", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  Plan plan;
  plan.steps = 4;
  plan.overflow_at = 2;
  run_profiled(path, std::make_shared<SyntheticGpu>(), plan);
  const auto run = analyzer::load_run(path);
  const auto report = analyzer::analyze({run});
  const auto& p = report.runs.at(0).device_profile;
  CHECK(p.status == "synthetic");
  CHECK(p.steps == 4);
  REQUIRE(p.modules.size() == 3);
  CHECK(p.modules[0].module == "encoder.1");  // most device time first
  CHECK(p.modules[0].fp32 == Approx(1.0));
  CHECK(p.modules[1].module == "encoder.0");
  CHECK(p.modules[1].fp16 == Approx(1.0));
  CHECK(p.modules[1].us_per_step == Approx(0.8));
  const analyzer::Finding* pin = nullptr;
  for (const auto& f : report.findings)
    if (f.rule == "forward-nonfinite" && f.module == "encoder.0") pin = &f;
  REQUIRE(pin);
  REQUIRE(!pin->suggestions.empty());
  const std::string& cost = pin->suggestions.front().cost;
  INFO(cost);
  CHECK(cost.find("encoder.0 spends 0.8 us/step in fp16 kernels") != std::string::npos);
  CHECK(cost.find("about 3x that") != std::string::npos);
  CHECK(cost.find("measured: fp32 over fp16 time per kernel of the same module type in this run: Linear 3x") !=
        std::string::npos);
  const std::string text = analyzer::render_text(report, analyzer::Gate("error"));
  CHECK(text.find("cost:     encoder.0 spends") != std::string::npos);
  CHECK(p.ampdiag_us == Approx(0.1));
  CHECK(text.find("device profile: 4 steps, 2 us of device time per step; ampdiag's own kernels 0.1 us (4.5 %)") !=
        std::string::npos);
  CHECK(text.find("encoder.1: 1.2 us/step (fp16 0 %, bf16 0 %, fp32 100 %") != std::string::npos);
}

TEST_CASE("the JSON and Markdown reports carry the device profile and the cost", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  Plan plan;
  plan.overflow_at = 1;
  run_profiled(path, std::make_shared<SyntheticGpu>(), plan);
  const auto report = analyzer::analyze({analyzer::load_run(path)});
  const std::string json = analyzer::render_json(report, analyzer::Gate("error"));
  CHECK(json.find("\"device_profile\": {\"status\": \"synthetic\", \"unavailable\": null, \"steps\": 3") !=
        std::string::npos);
  CHECK(json.find("\"cost\": \"encoder.0 spends 0.8 us/step in fp16 kernels") != std::string::npos);
  const std::string markdown = analyzer::render_markdown(report, analyzer::Gate("error"));
  CHECK(markdown.find("- cost: encoder.0 spends") != std::string::npos);
  CHECK(markdown.find("  - device profile: 3 steps") != std::string::npos);
}

TEST_CASE("without comparable fp32 kernels the pin cost states its assumption", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  Plan plan;
  plan.overflow_at = 1;
  plan.second = "head";
  plan.second_type = "Conv2d";  // fp32, but not a Linear
  run_profiled(path, std::make_shared<SyntheticGpu>(), plan);
  const std::string cost = encoder0_pin_cost(path);
  INFO(cost);
  CHECK(cost.find("about 2x that") != std::string::npos);
  CHECK(cost.find("assumed 2x for Linear, which ran no comparable fp32 kernels in this run") != std::string::npos);
}

TEST_CASE("steps the sampling skips record no device time", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  Plan plan;
  plan.steps = 4;
  plan.every = 2;
  run_profiled(path, std::make_shared<SyntheticGpu>(), plan);
  std::vector<std::int64_t> steps;
  for (const auto& r : rundb::RunDbReader(path).gpu_time())
    if (steps.empty() || steps.back() != r.step) steps.push_back(r.step);
  CHECK(steps == std::vector<std::int64_t>{0, 2});
}

TEST_CASE("a profiler that cannot start leaves one event, and the run goes on without it", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  auto gpu = std::make_shared<SyntheticGpu>();
  gpu->refuse = "cuptiActivityEnable(EXTERNAL_CORRELATION) failed: CUPTI_ERROR_UNKNOWN (999)";
  run_profiled(path, gpu, Plan{}, [](agent::Session& s) { CHECK_FALSE(s.profiling()); });
  CHECK(gpu->stack.empty());  // no range was ever pushed
  rundb::RunDbReader reader(path);
  CHECK(reader.steps().size() == 3);
  CHECK(reader.gpu_time().empty());
  int events = 0;
  for (const auto& e : reader.events()) events += e.kind == "profiler-unavailable";
  CHECK(events == 1);
  const auto report = analyzer::analyze({analyzer::load_run(path)});
  const std::string text = analyzer::render_text(report, analyzer::Gate("error"));
  CHECK(text.find("device profile: unavailable (device profiling is unavailable, training goes on without it: "
                  "cuptiActivityEnable(EXTERNAL_CORRELATION) failed: CUPTI_ERROR_UNKNOWN (999))") != std::string::npos);
  CHECK(text.find("HEALTHY") == 0);  // an unavailable profiler is not a finding
}

TEST_CASE("fp32 kernels faster than the half ones are not taken as comparable: no cost below nothing", "[profile]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  Plan plan;
  plan.overflow_at = 1;
  plan.fp32_ns = 100;  // a much smaller pinned Linear
  run_profiled(path, std::make_shared<SyntheticGpu>(), plan);
  const std::string cost = encoder0_pin_cost(path);
  INFO(cost);
  CHECK(cost.find("about 2x that (+0.8 us/step") != std::string::npos);
  CHECK(cost.find("Linear's fp32 kernels were faster per kernel than its fp16 ones") != std::string::npos);
}
