// A run.db written through the real RunDbWriter with overflow episodes in random layers
// and backward orders, zeros, subnormals, histograms, forward probes, and commits at
// irregular points (some in the middle of a step); and the check that two Runs read from
// files hold the same thing in every field the rules and views read.
#pragma once

#include <sqlite3.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/writer.h"

namespace ampdiag::test {

class RandomRun {
 public:
  // `modules`: probed modules, each with an activation row per step.
  RandomRun(const std::string& path, int layers, int modules = 0) : writer_(path, true), layers_(layers), modules_(modules) {
    writer_.set_meta("amp_dtype", "float16");
    writer_.set_meta("histogram", "1");
    for (int l = 0; l < layers; ++l)
      writer_.add_layer({l, "blocks." + std::to_string(l) + ".weight", "blocks." + std::to_string(l), "Linear", "float32",
                         "[64, 64]", 4096, true, ""});
    for (int m = 0; m < modules; ++m) writer_.add_module({m, "blocks." + std::to_string(m), "Linear", "", ""});
  }

  void steps(std::int64_t first, std::int64_t count) {
    for (std::int64_t s = first; s < first + count; ++s) step(s);
  }

  // A sampled step with its statistics (its row replaces an unsampled one of that step).
  void step(std::int64_t s) {
    const bool overflow = rng_() % 23 == 0;
    // Modules in another order every step, some not called (a router's experts).
    std::vector<int> called;
    for (int m = 0; m < modules_; ++m)
      if (rng_() % 4 != 0) called.push_back(m);
    std::shuffle(called.begin(), called.end(), rng_);
    for (std::size_t i = 0; i < called.size(); ++i) {
      const int m = called[i];
      rundb::ActStatRow a;
      a.step = s;
      a.fwd_order = std::int64_t(i);
      a.module_id = m;
      const bool bad = overflow && rng_() % 3 == 0;
      a.stats = {4096, bad ? 2 : 0, 0, 0, 0, double(rng_() % 60000), 0.01, 100.0};
      writer_.add_act_stat(a);
      if (rng_() % 97 == 0) writer_.commit();  // forward rows split between two transactions
    }
    std::vector<int> order(static_cast<std::size_t>(layers_));
    for (int l = 0; l < layers_; ++l) order[std::size_t(l)] = l;
    std::shuffle(order.begin(), order.end(), rng_);
    for (int l = 0; l < layers_; ++l) {
      rundb::GradStatRow g;
      g.step = s;
      g.layer_id = l;
      g.bwd_order = std::find(order.begin(), order.end(), l) - order.begin();
      const bool bad = overflow && rng_() % 5 == 0;
      const double absmax = std::ldexp(1.0 + double(rng_() % 1000) / 1000.0, int(rng_() % 30) - 10);
      g.stats = {4096, bad ? 3 : 0, bad ? std::int64_t(rng_() % 2) : 0, std::int64_t(rng_() % 4096), std::int64_t(rng_() % 300),
                 absmax, absmax * std::ldexp(1.0, -int(rng_() % 40)), absmax * 30.0};
      g.histogram.assign(rundb::kHistBins, 0);
      for (int k = 0; k < 4; ++k) g.histogram[rng_() % rundb::kHistBins] += std::uint32_t(rng_() % 1000);
      writer_.add_grad_stat(g);
      if (rng_() % 997 == 0) writer_.commit();  // a step split between two transactions
    }
    add_step(s, overflow, true);
    if (rng_() % 7 == 0) writer_.commit();
  }

  // A step the agent did not sample: its row only (step() later records it after all, as
  // the agent does for the steps before an overflow).
  void unsampled_step(std::int64_t s) { add_step(s, false, false); }

  rundb::RunDbWriter& writer() { return writer_; }

 private:
  void add_step(std::int64_t s, bool skipped, bool sampled) {
    rundb::StepRow row;
    row.step = s;
    row.loss = 1.0;
    row.losses = 1;
    row.scale_before = row.scale_after = 1024.0;
    row.found_inf = row.skipped = skipped;
    row.sampled = sampled;
    writer_.add_step(row);
  }

  rundb::RunDbWriter writer_;
  int layers_, modules_;
  std::mt19937 rng_{12345};
};

// load_run as a window following a training does: a file still being written is read too.
inline analyzer::Run load_partial(const std::string& path, bool full_scan = false) {
  analyzer::LoadOptions o;
  o.full_scan = full_scan;
  o.allow_unfinished = true;
  return analyzer::load_run(path, o);
}

// Runs SQL on the file behind the writer's back (damage, a file from before a table existed).
inline void exec_sql(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, nullptr);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

inline bool same_samples(const std::vector<analyzer::GradSample>& a, const std::vector<analyzer::GradSample>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].step != b[i].step || std::memcmp(&a[i].absmax, &b[i].absmax, 4) != 0 || std::memcmp(&a[i].l2, &b[i].l2, 4) != 0 ||
        a[i].zero_q != b[i].zero_q || a[i].nonfinite != b[i].nonfinite || a[i].sub_q != b[i].sub_q)
      return false;
  return true;
}

// Every field the rules and views read, layer by layer, module by module, step by step.
inline void require_same_run(const analyzer::Run& a, const analyzer::Run& b) {
  REQUIRE(a.grad_rows == b.grad_rows);
  REQUIRE(a.act_rows == b.act_rows);
  CHECK(a.finished == b.finished);
  CHECK(a.meta == b.meta);
  REQUIRE(a.layers.size() == b.layers.size());
  for (std::size_t l = 0; l < b.layers.size(); ++l) {
    INFO("layer " << l);
    const auto& x = a.layers[l];
    const auto& y = b.layers[l];
    CHECK(x.info.name == y.info.name);
    CHECK(same_samples(x.samples, y.samples));
    CHECK(x.nonfinite_steps == y.nonfinite_steps);
    CHECK(x.first_nonfinite == y.first_nonfinite);
    CHECK(x.least_nonzero == y.least_nonzero);
    CHECK(x.least_nonzero_step == y.least_nonzero_step);
    CHECK(x.histogram == y.histogram);
  }
  REQUIRE(a.modules.size() == b.modules.size());
  for (std::size_t m = 0; m < b.modules.size(); ++m) {
    INFO("module " << m);
    CHECK(a.modules[m].info.path == b.modules[m].info.path);
    CHECK(a.modules[m].nonfinite_steps == b.modules[m].nonfinite_steps);
    CHECK(a.modules[m].first_nonfinite == b.modules[m].first_nonfinite);
    CHECK(a.modules[m].first_step == b.modules[m].first_step);
    CHECK(a.modules[m].before_known == b.modules[m].before_known);
    CHECK(a.modules[m].before_first == b.modules[m].before_first);
    CHECK(a.modules[m].jump_absmax == b.modules[m].jump_absmax);
    CHECK(a.modules[m].jump_before == b.modules[m].jump_before);
    CHECK(a.modules[m].before_last == b.modules[m].before_last);
    CHECK(a.modules[m].position == b.modules[m].position);
    const analyzer::CallGrowth &ga = a.modules[m].growth, &gb = b.modules[m].growth;
    CHECK(ga.step == gb.step);
    CHECK(ga.micro_batch == gb.micro_batch);
    CHECK(ga.calls == gb.calls);
    CHECK(ga.nonfinite_call == gb.nonfinite_call);
    CHECK(ga.from_call == gb.from_call);
    CHECK(ga.to_call == gb.to_call);
    CHECK(ga.rises == gb.rises);
    CHECK(ga.from == gb.from);
    CHECK(ga.to == gb.to);
    CHECK(a.modules[m].last_steps + (a.cursor.act_step_last == std::int64_t(m)) ==
          b.modules[m].last_steps + (b.cursor.act_step_last == std::int64_t(m)));
    CHECK(a.modules[m].max_absmax == b.modules[m].max_absmax);
  }
  CHECK((a.last_module() ? a.last_module()->info.path : "") == (b.last_module() ? b.last_module()->info.path : ""));
  REQUIRE(a.steps.size() == b.steps.size());
  for (std::size_t i = 0; i < b.steps.size(); ++i) {
    INFO("step " << b.steps[i].row.step);
    CHECK(a.steps[i].row.step == b.steps[i].row.step);
    CHECK(a.steps[i].row.sampled == b.steps[i].row.sampled);
    CHECK(a.steps[i].row.skipped == b.steps[i].row.skipped);
    CHECK(a.steps[i].nonfinite_layers == b.steps[i].nonfinite_layers);
    CHECK(a.steps[i].last_finite_before == b.steps[i].last_finite_before);
    CHECK(a.steps[i].first_nonfinite_module == b.steps[i].first_nonfinite_module);
  }
}

}  // namespace ampdiag::test
