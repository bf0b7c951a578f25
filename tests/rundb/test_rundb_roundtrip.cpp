// What the writer stores, the reader returns.
#include <catch2/catch.hpp>

#include <cmath>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/schema.h"
#include "ampdiag/rundb/writer.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::TempDir;

TEST_CASE("every table round-trips through writer and reader", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.set_meta("amp_dtype", "float16");
    w.add_layer({0, "block1.0.attn.qkv.weight", "block1.0.attn.qkv", "Linear", "float32", "[96, 32]", 3072, true, ""});
    w.add_layer({1, "embed.weight", "embed", "Linear", "float32", "[32, 32]", 1024, false, "model.py:12"});
    w.add_module({0, "block1.0.attn", "Attention", ""});
    StepRow s;
    s.step = 3;
    s.loss = std::nan("");
    s.scale_before = 65536;
    s.scale_after = 32768;
    s.found_inf = s.skipped = s.sampled = true;
    s.step_ns = 1234;
    s.agent_ns = 56;
    s.wall_time = 1.7e9;
    w.add_step(s);
    GradStatRow g;
    g.step = 3;
    g.layer_id = 0;
    g.bwd_order = 7;
    g.stats = {3072, 5, 2, 10, 1, 65000.0, 1e-9, 123.5};
    g.histogram = {1, 2, 3};
    w.add_grad_stat(g);
    w.add_act_stat({3, 0, 2, {10, 0, 1, 0, 0, 5.0, 0.5, 7.0}});
    w.add_event({3, "dropped", "4 records", 1.0});
    w.finish();
  }
  RunDbReader r(path);
  CHECK(r.schema_version() == kSchemaVersion);
  CHECK(r.finished());
  CHECK(r.meta().at("amp_dtype") == "float16");
  const auto layers = r.layers();
  REQUIRE(layers.size() == 2);
  CHECK(layers[0].name == "block1.0.attn.qkv.weight");
  CHECK(layers[1].trainable == false);
  CHECK(layers[1].source == "model.py:12");
  REQUIRE(r.modules().size() == 1);
  const auto steps = r.steps();
  REQUIRE(steps.size() == 1);
  CHECK(std::isnan(steps[0].loss));
  CHECK(steps[0].scale_after == 32768);
  CHECK(steps[0].skipped);
  const auto grads = r.grad_stats();
  REQUIRE(grads.size() == 1);
  CHECK(grads[0].bwd_order == 7);
  CHECK(grads[0].stats.inf == 2);
  CHECK(grads[0].stats.absmax == 65000.0);
  CHECK(grads[0].histogram == std::vector<std::uint32_t>{1, 2, 3});
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 1);
  CHECK(acts[0].fwd_order == 2);
  CHECK(acts[0].stats.inf == 1);
  CHECK(acts[0].stats.l2 == 7.0);
  REQUIRE(r.events().size() == 1);
  CHECK(r.events()[0].kind == "dropped");
}

TEST_CASE("a run that was not finished reads as unfinished", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  RunDbWriter w(path, false);
  w.add_step({});
  w.commit();
  RunDbReader r(path);
  CHECK_FALSE(r.finished());
  CHECK(r.steps().size() == 1);
}
