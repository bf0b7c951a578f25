// The torch-free session core: the registry and metadata both agents use, CPU statistics
// recorded at once, the engine chosen per tensor, and activations checked or sampled.
// Device statistics as tickets: test_tickets.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "fake_device.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

// One step in which layers 0 and 1 have the host gradients `g0` and `g1` (8 values each),
// layer 1's arriving first; what grads() said (NaN/Inf found).
bool step_with_two_gradients(agent::Session& s, std::vector<float>& g0, std::vector<float>& g1) {
  const std::int64_t ids[] = {0, 1};
  const DeviceTensor t[] = {{{g0.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{g1.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}};
  s.begin_cycle();
  s.arrived(1);
  s.arrived(0);
  agent::GradBatch b;
  b.layers = ids;
  b.tensors = t;
  b.count = 2;
  const bool found = s.grads(b);
  s.end_step({}, 0);
  return found;
}

}  // namespace

TEST_CASE("CPU gradients are computed at once and recorded with their arrival order", "[session]") {
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 2);
    std::vector<float> g0(8, 2.0f), g1(8, std::numeric_limits<float>::infinity());
    CHECK(step_with_two_gradients(s, g0, g1));  // found_inf from the host pass, at once
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto rows = grads_of(r, 0);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].layer_id == 0);
  CHECK(rows[0].bwd_order == 1);
  CHECK(rows[0].stats.absmax == 2.0f);
  CHECK(rows[1].bwd_order == 0);
  CHECK(rows[1].stats.inf == 8);
}

TEST_CASE("a layer added after the model's layers has its arrival order recorded", "[session][registry]") {
  // A block grown or a head swapped in after attach(): registered when the optimizer hands
  // its gradient over, its arrival hook counted like the others'.
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 1);
    const auto added = s.add_layer(std::uintptr_t(2000), float_layer("extra.weight", "extra"));
    REQUIRE(added.added);
    REQUIRE(added.id == 1);
    std::vector<float> g0(8, 2.0f), g1(8, 3.0f);
    CHECK_FALSE(step_with_two_gradients(s, g0, g1));
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto rows = grads_of(r, 0);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].bwd_order == 1);
  CHECK(rows[1].bwd_order == 0);
}

TEST_CASE("a layer added under a name already recorded gets the step it came in", "[session][registry]") {
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 1);
    const auto info = float_layer("l0.weight", "l0");  // a new tensor where the old one was (a head swapped in)
    CHECK(s.add_layer(std::uintptr_t(2000), info).added);
    CHECK(s.add_layer(std::uintptr_t(2001), info).name == "l0.weight (from step 0) #2");  // the adapters' events say it
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  std::vector<std::string> names;
  for (const auto& l : r.layers()) names.push_back(l.name);
  CHECK(names == std::vector<std::string>{"l0.weight", "l0.weight (from step 0)", "l0.weight (from step 0) #2"});
  CHECK(r.meta().count("write_error") == 0);
}

TEST_CASE("a gradient read twice in one step is recorded once, its later reading, and the recording goes on",
          "[session]") {
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 2);
    std::vector<float> first(8, 1.0f), second(8, 3.0f), other(8, 2.0f);
    for (int step = 0; step < 2; ++step) {
      s.begin_cycle();
      host_grad(s, 0, first.data(), 8);
      host_grad(s, 1, other.data(), 8);
      host_grad(s, 0, second.data(), 8);
      s.end_step({}, 0);
    }
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK(r.meta().count("write_error") == 0);
  for (std::int64_t step = 0; step < 2; ++step) {
    const auto rows = grads_of(r, step);
    REQUIRE(rows.size() == 2);
    CHECK(rows[0].layer_id == 0);
    CHECK(rows[0].stats.absmax == 3.0f);
    CHECK(rows[1].stats.absmax == 2.0f);
  }
}

TEST_CASE("the backward origin is the first NaN/Inf gradient in arrival order and the finite one before it",
          "[session]") {
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 4);
  const float inf = std::numeric_limits<float>::infinity();
  // Optimizer order 0..3; backward reaches 3, 2, 1, 0: layer 2 goes Inf first, 3 arrived finite before it.
  std::vector<float> g0(8, inf), g1(8, 1.0f), g2(8, inf), g3(8, 1.0f);
  const std::int64_t ids[] = {0, 1, 2, 3};
  const DeviceTensor t[] = {{{g0.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{g1.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{g2.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{g3.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}};
  agent::GradBatch b;
  b.layers = ids;
  b.tensors = t;
  b.count = 4;
  s.begin_cycle();
  for (std::int64_t layer : {3, 2, 1, 0}) s.arrived(layer);
  REQUIRE(s.grads(b));
  CHECK(s.backward_origin() == std::pair<std::int64_t, std::int64_t>{2, 3});
  s.end_step({}, 0);

  g2.assign(8, 1.0f);  // the next step: only layer 0, the last to arrive, and a finite step after it
  s.begin_cycle();
  for (std::int64_t layer : {3, 2, 1, 0}) s.arrived(layer);
  REQUIRE(s.grads(b));
  CHECK(s.backward_origin() == std::pair<std::int64_t, std::int64_t>{0, 1});
  s.end_step({}, 0);
  g0.assign(8, 1.0f);
  s.begin_cycle();
  CHECK_FALSE(s.grads(b));
  CHECK(s.backward_origin() == std::pair<std::int64_t, std::int64_t>{-1, -1});
  s.end_step({}, 0);
  s.close();
}

TEST_CASE("within one backward a layer keeps its first arrival", "[session]") {
  // A tied weight placed where its NaN part arrived (the tied look), then its summed
  // gradient's own hook later in the same backward.
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 3);
  s.begin_cycle();
  s.backward_began();
  for (std::int64_t layer : {0, 2, 1, 0}) s.arrived(layer);
  CHECK(s.arrival(0) == 0);
  CHECK(s.arrival(2) == 1);
  CHECK(s.arrival(1) == 2);
  s.end_step({}, 0);
  s.close();
}

TEST_CASE("a layer a later backward of the step reaches again is ordered by that arrival", "[session]") {
  // A main loss and an auxiliary one, each given its own backward: the first reaches the
  // main head (2) and the shared trunk (0), the second the auxiliary head (1) and the trunk
  // again. The auxiliary loss's NaN makes the auxiliary head's gradient and the trunk's sum
  // NaN: its head went first, though the trunk's first arrival was before it.
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 3);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> trunk(8, nan), aux(8, nan), main(8, 1.0f);
  const std::int64_t ids[] = {0, 1, 2};
  const DeviceTensor t[] = {{{trunk.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{aux.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{main.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}};
  agent::GradBatch b;
  b.layers = ids;
  b.tensors = t;
  b.count = 3;
  s.begin_cycle();
  s.backward_began();
  for (std::int64_t layer : {2, 0}) s.arrived(layer);
  s.backward_began();
  for (std::int64_t layer : {1, 0}) s.arrived(layer);
  CHECK(s.arrival(0) > s.arrival(1));
  REQUIRE(s.grads(b));
  CHECK(s.backward_origin() == std::pair<std::int64_t, std::int64_t>{1, 2});
  s.end_step({}, 0);
  s.close();
}

namespace {

// One step in which layer `first`'s gradient is Inf, the first to go NaN/Inf in backward,
// and layer `before`'s (-1: none) finite, arriving just before it; what origin_module() says.
std::string skip_with(agent::Session& s, std::int64_t first, std::int64_t before) {
  std::vector<float> inf(8, std::numeric_limits<float>::infinity()), finite(8, 1.0f);
  std::vector<std::int64_t> ids{first};
  std::vector<DeviceTensor> t{{{inf.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}};
  if (before >= 0) {
    ids.push_back(before);
    t.push_back({{finite.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr});
  }
  s.begin_cycle();
  if (before >= 0) s.arrived(before);
  s.arrived(first);
  agent::GradBatch b;
  b.layers = ids.data();
  b.tensors = t.data();
  b.count = ids.size();
  s.grads(b);
  std::string named = s.origin_module();
  s.end_step({}, 0);
  return named;
}

// Opens `s` at `db` with the model's layers at `paths` (layer i in module paths[i]).
void open_with_paths(agent::Session& s, const std::string& db, const std::vector<std::string>& paths) {
  for (std::size_t i = 0; i < paths.size(); ++i)
    s.add_layer(std::uintptr_t(1000 + i), float_layer(paths[i] + ".weight", paths[i]));
  s.layers_done();
  s.open(db, {}, "test-run");
}

// skip_with() in a session whose model has its layers at `paths`.
std::string origin_of(const std::vector<std::string>& paths, std::int64_t first, std::int64_t before) {
  TempDir dir;
  agent::Session s(options());
  open_with_paths(s, dir.file("run.db"), paths);
  std::string named = skip_with(s, first, before);
  s.close();
  return named;
}

}  // namespace

TEST_CASE("the module a skip names is the innermost holding its first NaN/Inf gradient and the finite one before it",
          "[session][origin]") {
  CHECK(origin_of({"enc.2", "enc.3", "head"}, 0, 1) == "enc");
  CHECK(origin_of({"enc.1", "enc.10", "head"}, 0, 1) == "enc");  // by whole components
  CHECK(origin_of({"enc.2.attn", "enc.2", "head"}, 0, 1) == "enc.2");
}

TEST_CASE("a skip whose two layers only the model holds names the first one's module", "[session][origin]") {
  CHECK(origin_of({"enc.2", "head"}, 0, 1) == "enc.2");
}

TEST_CASE("a module holding every layer is the model's place, not a module a skip names", "[session][origin]") {
  // A model attached in its DistributedDataParallel wrapper: every layer is under "module".
  CHECK(origin_of({"module.enc", "module.head"}, 0, 1) == "module.enc");
  CHECK(origin_of({"enc.2", "enc.3"}, 0, 1) == "enc.2");  // a model that is all one encoder
  CHECK(origin_of({"module.enc.0", "module.enc.1", "module.head"}, 0, 1) == "module.enc");
}

TEST_CASE("a skip whose first NaN/Inf gradient arrived first names that layer's module", "[session][origin]") {
  CHECK(origin_of({"enc.2", "enc.3", "head"}, 0, -1) == "enc.2");
}

TEST_CASE("a step whose gradients are all finite names no module", "[session][origin]") {
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 1);
  std::vector<float> finite(8, 1.0f);
  s.begin_cycle();
  host_grad(s, 0, finite.data(), 8);
  CHECK(s.origin_module().empty());
  s.end_step({}, 0);
  s.close();
}

TEST_CASE("an optimized tensor outside the model does not make its module the place a skip names",
          "[session][origin]") {
  // Its layer has no module: the innermost holding it and the model's layer is the model.
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 1);
  agent::LayerInfo foreign;
  foreign.dtype = "float32";
  foreign.numel = 8;
  const std::int64_t outside = s.layer_of(std::uintptr_t(5000), foreign).id;
  CHECK(skip_with(s, 0, outside) == "l0");
  s.close();
}

namespace {

// One step in a session whose model has its layers at `paths`, arriving in that order, the
// layers in `bad` Inf and the rest finite; what nonfinite_modules(limit) says.
std::vector<std::string> others_nonfinite(const std::vector<std::string>& paths, const std::vector<std::size_t>& bad,
                                          std::size_t limit = 3) {
  TempDir dir;
  agent::Session s(options());
  open_with_paths(s, dir.file("run.db"), paths);
  std::vector<std::vector<float>> values;
  std::vector<std::int64_t> ids;
  std::vector<DeviceTensor> t;
  values.reserve(paths.size());
  s.begin_cycle();
  for (std::size_t i = 0; i < paths.size(); ++i) {
    const bool inf = std::find(bad.begin(), bad.end(), i) != bad.end();
    values.emplace_back(8, inf ? std::numeric_limits<float>::infinity() : 1.0f);
    ids.push_back(std::int64_t(i));
    t.push_back({{values.back().data(), 8, kernels::DType::kFloat32}, kCpu, nullptr});
    s.arrived(std::int64_t(i));
  }
  agent::GradBatch b;
  b.layers = ids.data();
  b.tensors = t.data();
  b.count = ids.size();
  s.grads(b);
  std::vector<std::string> others = s.nonfinite_modules(limit);
  s.end_step({}, 0);
  s.close();
  return others;
}

}  // namespace

TEST_CASE("the other modules whose gradients went NaN/Inf in a skip are listed in arrival order, apart from the one "
          "it names",
          "[session][origin]") {
  using Paths = std::vector<std::string>;
  CHECK(others_nonfinite({"out", "k", "k.inner", "v", "q", "q"}, {1, 2, 4, 5}) == Paths{"q"});
  CHECK(others_nonfinite({"out", "k", "v", "q"}, {1, 2, 3}) == Paths{"v", "q"});
  CHECK(others_nonfinite({"a", "b", "c", "d", "e"}, {0, 1, 2, 3, 4}, 2) == Paths{"b", "c"});
  CHECK(others_nonfinite({"out", "k", "q"}, {1}).empty());
  CHECK(others_nonfinite({"out", "k", "q"}, {}).empty());
}

TEST_CASE("a step's agent_ns is the adapter's: the session's statistics calls are inside its timing", "[session]") {
  // Both agents time their hooks around the session's calls; if the session added its own
  // time too, the pass would be counted twice.
  TempDir dir;
  {
    agent::Session s(options());
    open_with_layers(s, dir.file("run.db"), 1);
    std::vector<float> grad(std::size_t(1) << 22, 0.5f), output(std::size_t(1) << 20, 0.25f);
    const std::int64_t id = 0;
    s.begin_cycle();
    s.activation(s.module_id("m", "Linear", "", ""), {{output.data(), std::int64_t(output.size()),
                                                       kernels::DType::kFloat32}, kCpu, nullptr}, 0);
    host_grad(s, id, grad.data(), std::int64_t(grad.size()));
    s.end_step({}, 1234);
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto steps = r.steps();
  REQUIRE(steps.size() == 1);
  CHECK(steps[0].agent_ns == 1234);
}

TEST_CASE("the engine is chosen by the tensor's device, and device memory never reaches the CPU engine", "[session]") {
  FakeDeviceRun run(3);
  agent::Session& s = run.session;
  CHECK(s.engine_for(kCpu) == agent::EngineKind::kCpu);
  CHECK(s.engine_for(kGpu0) == agent::EngineKind::kCuda);
  CHECK(s.engine_for({DeviceType::kCuda, 3}) == agent::EngineKind::kCuda);
  device_cycle(s, 3);
  const auto& launches = run.launches;
  REQUIRE(launches->size() == 1);  // one launch for the device's gradients
  CHECK((*launches)[0]->data == std::vector<const void*>{device_pointer(0), device_pointer(1), device_pointer(2)});
  CHECK((*launches)[0]->as.orders == std::vector<std::int64_t>{2, 1, 0});
}

TEST_CASE("gradients on several devices and streams get one launch each, host ones none", "[session]") {
  FakeDeviceRun run(4);
  agent::Session& s = run.session;
  const auto& launches = run.launches;
  std::vector<float> host(8, 1.0f);
  int stream_a = 0, stream_b = 0;
  const std::int64_t ids[] = {0, 1, 2, 3};
  const DeviceTensor t[] = {{{device_pointer(0), 8, kernels::DType::kFloat16}, kGpu0, &stream_a},
                            {{host.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr},
                            {{device_pointer(2), 8, kernels::DType::kFloat32}, {DeviceType::kCuda, 1}, &stream_b},
                            {{device_pointer(3), 8, kernels::DType::kFloat32}, kGpu0, &stream_a}};
  agent::GradBatch b;
  b.layers = ids;
  b.tensors = t;
  b.count = 4;
  s.begin_cycle();
  s.grads(b);
  REQUIRE(launches->size() == 2);
  CHECK((*launches)[0]->as.ids == std::vector<std::int64_t>{0, 3});
  CHECK((*launches)[0]->launch.stream == &stream_a);
  CHECK((*launches)[1]->as.ids == std::vector<std::int64_t>{2});
  CHECK((*launches)[1]->launch.device.index == 1);
}

TEST_CASE("with histograms on, a host activation's exponent histogram counts its values' binades", "[session]") {
  TempDir dir;
  agent::SessionOptions o = options();
  o.histogram = true;
  const std::vector<float> values = {0.5f, 0.75f, 3.0f, 3.5f, 1e-20f, 0.0f, 70000.0f, -4.0f};
  {
    agent::Session s(o);
    open_with_layers(s, dir.file("run.db"), 1);
    s.begin_cycle();
    const auto m = s.module_id("enc", "Linear", "", "");
    s.activation(m, {{values.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0);
    s.end_step({}, 0);
    s.close();
  }
  // Directly: bin 0 below 2^kHistMinExp, bin 1 + (e - kHistMinExp) for 2^e <= |x| < 2^(e+1).
  std::vector<std::uint32_t> expected(rundb::kHistBins, 0);
  for (const float v : values) {
    if (v == 0.0f) continue;
    const int e = std::ilogb(v);
    expected[e < rundb::kHistMinExp ? 0 : std::size_t(1 + e - rundb::kHistMinExp)] += 1;
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 1);
  CHECK(acts[0].histogram == expected);
}

TEST_CASE("between full activation steps a host output is only checked: a row only when it holds NaN/Inf",
          "[session]") {
  TempDir dir;
  agent::SessionOptions o = options();
  o.recorder.every = 2;
  o.activation_every = 2;  // full statistics on steps 0, 4, 8, ...
  const std::vector<float> finite(8, 2.0f);
  std::vector<float> overflowed(8, 3.0f);
  overflowed[5] = std::numeric_limits<float>::infinity();
  std::vector<bool> reported;
  {
    agent::Session s(o);
    open_with_layers(s, dir.file("run.db"), 1);
    const auto m = s.module_id("enc", "Linear", "", "");
    for (int step = 0; step < 5; ++step) {
      s.begin_cycle();
      reported.push_back(s.activation(m, {{finite.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0));
      reported.push_back(s.activation(m, {{overflowed.data(), 8, kernels::DType::kFloat32}, kCpu, nullptr}, 0));
      s.end_step({}, 0);
    }
    s.close();
  }
  CHECK(reported == std::vector<bool>{false, true, false, true, false, true, false, true, false, true});
  rundb::RunDbReader r(dir.file("run.db"));
  std::vector<std::pair<std::int64_t, std::int64_t>> rows;  // (step, fwd_order)
  for (const auto& a : r.act_stats()) {
    rows.push_back({a.step, a.fwd_order});
    CHECK(a.stats.absmax == (a.fwd_order == 0 ? 2.0f : 3.0f));  // full statistics, also for a checked one
  }
  // Steps 0 and 4: both outputs; step 2 (recorded, not full): the overflowed one only, at
  // its own forward position; odd steps are not recorded (every = 2).
  const std::vector<std::pair<std::int64_t, std::int64_t>> want = {{0, 0}, {0, 1}, {2, 1}, {4, 0}, {4, 1}};
  CHECK(rows == want);
}

TEST_CASE("activation_every below 1 is refused", "[session]") {
  agent::SessionOptions o = options();
  o.activation_every = 0;
  CHECK_THROWS_WITH(agent::Session(o), Catch::Contains("activation_every"));
}

TEST_CASE("rows posted before the file opens are written when it opens", "[session][registry]") {
  TempDir dir;
  {
    agent::Session s(options());
    agent::LayerInfo w;
    w.name = "enc.weight";
    w.dtype = "float32";
    const auto first = s.add_layer(1, w);
    CHECK(first.added);
    agent::LayerInfo tied = w;
    tied.name = "dec.weight";
    const auto again = s.add_layer(1, tied);  // the same tensor: the first id
    CHECK(again.id == first.id);
    CHECK_FALSE(again.added);
    agent::LayerInfo frozen = w;
    frozen.name = "emb.weight";
    frozen.trainable = false;
    s.add_layer(2, frozen);
    s.layers_done();
    s.module_id("enc", "Linear", "", "");
    agent::RunMeta m;
    m.source = "test";
    m.scaler_init_scale = 65536.0;
    m.scaler_growth_factor = 2.0;
    m.scaler_backoff_factor = 0.5;
    m.scaler_growth_interval = 2000;
    s.write_meta(m);
    CHECK(s.layer_of(3, w).id == 2);  // an optimized tensor the model does not hold
    s.open(dir.file("run.db"), {1, 4}, "");
    s.close();
  }
  rundb::RunDbReader r(dir.file("run.db"));
  const auto layers = r.layers();
  REQUIRE(layers.size() == 3);
  CHECK(layers[2].name == "optimizer.param2");
  CHECK(r.modules().size() == 1);
  auto meta = r.meta();
  CHECK(meta["rank"] == "1");
  CHECK(meta["world_size"] == "4");
  CHECK(!meta["run_id"].empty());
  CHECK(meta["scaler_init_scale"] == "65536");
  CHECK(meta["scaler_backoff_factor"] == "0.5");
  std::vector<std::string> kinds;
  for (const auto& e : r.events()) kinds.push_back(e.kind);
  std::sort(kinds.begin(), kinds.end());
  CHECK(kinds == std::vector<std::string>{"foreign-parameter", "frozen-parameters", "shared-parameter"});
}

TEST_CASE("without a device engine, device tensors get a one-time event and no statistics", "[session]") {
  TempDir dir;
  agent::Session s(options());
  open_with_layers(s, dir.file("run.db"), 1);
  const auto real = agent::make_cuda_engine();
  if (real && real->unavailable().empty()) return;  // a real device would run the (bogus) pointers
  device_cycle(s, 1);
  device_cycle(s, 1);
  s.close();
  rundb::RunDbReader r(dir.file("run.db"));
  CHECK(r.grad_stats().empty());
  int events = 0;
  for (const auto& e : r.events()) events += e.kind == "slow-path" ? 1 : 0;
  CHECK(events == 1);
}
