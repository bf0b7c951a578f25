// What the writer stores, the reader returns.
#include <catch2/catch.hpp>

#include <cmath>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/schema.h"
#include "ampdiag/rundb/writer.h"
#include "run_sql.h"
#include "temp_dir.h"

using namespace ampdiag::rundb;
using ampdiag::test::run_sql;
using ampdiag::test::TempDir;

TEST_CASE("every table round-trips through writer and reader", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.set_meta("amp_dtype", "float16");
    w.add_layer({0, "block1.0.attn.qkv.weight", "block1.0.attn.qkv", "Linear", "float32", "[96, 32]", 3072, true, ""});
    w.add_layer({1, "embed.weight", "embed", "Linear", "float32", "[32, 32]", 1024, false, "model.py:12"});
    w.add_module({0, "block1.0.attn", "Attention", "", "float16, int64"});
    StepRow s;
    s.step = 3;
    s.loss = std::nan("");
    s.losses = 4;
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
    g.histogram.assign(kHistBins, 0);
    g.histogram[0] = 1, g.histogram[kHistBins - 1] = 3;
    w.add_grad_stat(g);
    w.add_act_stat({3, 0, 2, 1, {10, 0, 1, 0, 0, 5.0, 0.5, 7.0}, {}});
    w.add_event({3, "dropped", "4 records", 1.0});
    w.add_replay({3, "block1.0.attn", "unconfirmed", std::nan(""), "the replay raised RuntimeError: shapes"});
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
  CHECK(r.modules()[0].inputs == "float16, int64");
  const auto steps = r.steps();
  REQUIRE(steps.size() == 1);
  CHECK(std::isnan(steps[0].loss));
  CHECK(steps[0].losses == 4);
  CHECK(steps[0].scale_after == 32768);
  CHECK(steps[0].skipped);
  const auto grads = r.grad_stats();
  REQUIRE(grads.size() == 1);
  CHECK(grads[0].bwd_order == 7);
  CHECK(grads[0].stats.inf == 2);
  CHECK(grads[0].stats.absmax == 65000.0);
  REQUIRE(grads[0].histogram.size() == std::size_t(kHistBins));
  CHECK(grads[0].histogram.front() == 1);
  CHECK(grads[0].histogram.back() == 3);
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 1);
  CHECK(acts[0].fwd_order == 2);
  CHECK(acts[0].stats.inf == 1);
  CHECK(acts[0].stats.l2 == 7.0);
  CHECK(acts[0].micro_batch == 1);
  REQUIRE(r.events().size() == 1);
  CHECK(r.events()[0].kind == "dropped");
  const auto replays = r.replays();
  REQUIRE(replays.size() == 1);
  CHECK(replays[0].module == "block1.0.attn");
  CHECK(replays[0].outcome == "unconfirmed");
  CHECK(std::isnan(replays[0].fp32_absmax));
  CHECK(replays[0].reason.find("shapes") != std::string::npos);
}

TEST_CASE("an activation's histogram round-trips; a row without one reads empty", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    RunDbWriter w(path, false);
    w.add_module({0, "block", "Linear", "", ""});
    ActStatRow a{0, 0, 0, 0, {10, 0, 0, 0, 0, 5.0, 0.5, 7.0}, {}};
    w.add_act_stat(a);
    a.fwd_order = 1;
    a.histogram.assign(kHistBins, 0);
    a.histogram[1] = 4, a.histogram[kHistBins - 2] = 6;
    w.add_act_stat(a);
    w.finish();
  }
  RunDbReader r(path);
  const auto acts = r.act_stats();
  REQUIRE(acts.size() == 2);
  CHECK(acts[0].histogram.empty());
  REQUIRE(acts[1].histogram.size() == std::size_t(kHistBins));
  CHECK(acts[1].histogram[1] == 4);
  CHECK(acts[1].histogram[kHistBins - 2] == 6);
}

TEST_CASE("the writer refuses a histogram that is not kHistBins counts", "[rundb]") {
  TempDir dir;
  RunDbWriter w(dir.file("run.db"), false);
  w.add_module({0, "block", "Linear", "", ""});
  ActStatRow a{0, 0, 0, 0, {10, 0, 0, 0, 0, 5.0, 0.5, 7.0}, std::vector<std::uint32_t>(3, 1)};
  CHECK_THROWS_WITH(w.add_act_stat(a), Catch::Contains("3 bins"));
}

TEST_CASE("a format 1 run.db still reads: replays from its events, losses not known", "[rundb]") {
  TempDir dir;
  const auto path = dir.file("v1.db");
  // The format 1 tables as ampdiag 0.1 wrote them (the columns the reader selects).
  const char* v1 = R"sql(
    PRAGMA application_id = 1095585860;
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
    CREATE TABLE layers (id INTEGER PRIMARY KEY, name TEXT, module_path TEXT, module_type TEXT, dtype TEXT, shape TEXT,
                         numel INTEGER, trainable INTEGER, source TEXT);
    CREATE TABLE modules (id INTEGER PRIMARY KEY, path TEXT, module_type TEXT, source TEXT);
    CREATE TABLE grad_stats (step INTEGER, layer_id INTEGER, bwd_order INTEGER, numel INTEGER, nan INTEGER,
                             inf INTEGER, zeros INTEGER, fp16_subnormal INTEGER, absmax REAL, amin_nz REAL, l2 REAL,
                             histogram BLOB, PRIMARY KEY (step, layer_id)) WITHOUT ROWID;
    CREATE TABLE steps (step INTEGER PRIMARY KEY, loss REAL, scale_before REAL, scale_after REAL, found_inf INTEGER,
                        skipped INTEGER, sampled INTEGER, step_ns INTEGER, agent_ns INTEGER, wall_time REAL);
    CREATE TABLE act_stats (step INTEGER, fwd_order INTEGER, module_id INTEGER, numel INTEGER, nan INTEGER,
                            inf INTEGER, zeros INTEGER, fp16_subnormal INTEGER, absmax REAL, amin_nz REAL, l2 REAL);
    CREATE TABLE events (id INTEGER PRIMARY KEY, step INTEGER, kind TEXT, detail TEXT, wall_time REAL);
    INSERT INTO meta VALUES ('schema_version', '1');
    INSERT INTO modules VALUES (0, 'block.bn2', 'BatchNorm2d', '');
    INSERT INTO steps VALUES (0, NULL, 1024, 512, 1, 1, 1, 10, 1, 1.7e9);
    INSERT INTO act_stats VALUES (0, 0, 0, 10, 1, 0, 0, 0, 1.0, 1.0, 1.0);
    INSERT INTO events VALUES (1, 0, 'replay', 'module=block.bn2 fp32_finite=0 fp32_absmax=nan', 1.0);
    INSERT INTO events VALUES (2, 0, 'replay', 'module=block fp32_finite=1 fp32_absmax=812.5', 1.0);
    INSERT INTO events VALUES (3, 0, 'replay', 'module=head error=RuntimeError: shape mismatch', 1.0);
    INSERT INTO events VALUES (4, -1, 'frozen-parameters', '2 parameters', 1.0);
  )sql";
  run_sql(path, v1);

  RunDbReader r(path);
  CHECK(r.schema_version() == 1);
  CHECK(r.steps().at(0).losses == -1);
  CHECK(r.modules().at(0).inputs.empty());
  CHECK(r.act_stats().at(0).micro_batch == 0);
  CHECK(r.act_stats().at(0).histogram.empty());  // act_stats has no histogram column
  REQUIRE(r.events().size() == 1);  // the replays are not events any more
  CHECK(r.events()[0].kind == "frozen-parameters");
  const auto replays = r.replays();
  REQUIRE(replays.size() == 3);
  CHECK(replays[0].module == "block.bn2");
  CHECK(replays[0].outcome == "nonfinite");
  CHECK(replays[1].module == "block");
  CHECK(replays[1].outcome == "finite");
  CHECK(replays[1].fp32_absmax == 812.5);
  CHECK(replays[2].module == "head");
  CHECK(replays[2].outcome == "unconfirmed");
  CHECK(replays[2].reason.find("shape mismatch") != std::string::npos);
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
