// The C++ samples reproduce their failure, and the same sample with --pin-fp32 is
// healthy: checked on the run.db each writes, through analyzer/rundb.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "../rundb/temp_dir.h"
#include "ampdiag/rundb/reader.h"

using namespace ampdiag;
using ampdiag::test::TempDir;

namespace {

rundb::RunDbReader run_sample(const std::string& binary, const std::string& db, const std::string& extra = "") {
  const std::string command = "'" + binary + "' --db '" + db + "' " + extra + " > /dev/null";
  REQUIRE(std::system(command.c_str()) == 0);
  return rundb::RunDbReader(db);
}

// Per skipped step, the layer whose gradient went non-finite first in backward order.
std::map<std::int64_t, std::string> first_nonfinite_layer(rundb::RunDbReader& r) {
  const auto layers = r.layers();
  std::map<std::int64_t, std::pair<std::int64_t, std::string>> best;
  for (const auto& g : r.grad_stats()) {
    if (g.stats.nan + g.stats.inf == 0) continue;
    auto& b = best[g.step];
    if (b.second.empty() || g.bwd_order < b.first) b = {g.bwd_order, layers[std::size_t(g.layer_id)].name};
  }
  std::map<std::int64_t, std::string> out;
  for (const auto& [step, b] : best) out[step] = b.second;
  return out;
}

// Per step, the module whose activation went non-finite first in forward order.
std::map<std::int64_t, std::string> first_nonfinite_module(rundb::RunDbReader& r) {
  const auto modules = r.modules();
  std::map<std::int64_t, std::string> out;
  for (const auto& a : r.act_stats())  // sorted by (step, fwd_order)
    if (a.stats.nan + a.stats.inf > 0 && !out.count(a.step)) out[a.step] = modules[std::size_t(a.module_id)].path;
  return out;
}

double lowest_scale(const std::vector<rundb::StepRow>& steps) {
  double lowest = INFINITY;
  for (const auto& s : steps) lowest = std::min(lowest, s.scale_after);
  return lowest;
}

}  // namespace

TEST_CASE("vit sample: block1.0.attn overflows in backward again and again and the scale collapses", "[samples]") {
  TempDir dir;
  auto r = run_sample(AMPDIAG_SAMPLE_VIT, dir.file("vit.db"));
  const auto steps = r.steps();
  std::int64_t skipped = 0, backoffs_after_recovery = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    skipped += steps[i].skipped;
    if (i > 15 && steps[i].skipped) ++backoffs_after_recovery;
  }
  CHECK(skipped >= 10);
  CHECK(backoffs_after_recovery >= 2);  // it keeps backing off, not just once at the start
  CHECK(lowest_scale(steps) < 128);
  const auto origin = first_nonfinite_layer(r);
  REQUIRE(origin.size() >= std::size_t(skipped));
  for (const auto& [step, layer] : origin) {
    INFO("step " << step);
    CHECK(layer.rfind("block1.0.attn.", 0) == 0);
  }
}

TEST_CASE("vit sample pinned: block1.0.attn in fp32 keeps the scale up", "[samples]") {
  TempDir dir;
  auto r = run_sample(AMPDIAG_SAMPLE_VIT, dir.file("vit.db"), "--pin-fp32 block1.0.attn");
  CHECK(lowest_scale(r.steps()) >= 65536);
  for (const auto& [step, layer] : first_nonfinite_layer(r)) CHECK(layer.rfind("block1.0.attn.", 0) != 0);
  for (const auto& s : r.steps()) CHECK(std::isfinite(s.loss));
}

TEST_CASE("linear attention sample: the normaliser makes the forward NaN from step 0", "[samples]") {
  TempDir dir;
  auto r = run_sample(AMPDIAG_SAMPLE_LINEAR_ATTENTION, dir.file("la.db"));
  for (const auto& s : r.steps()) {
    CHECK(std::isnan(s.loss));
    CHECK(s.skipped);
  }
  const auto first = first_nonfinite_module(r);
  REQUIRE(first.count(0) == 1);
  for (const auto& [step, module] : first) CHECK(module == "encoder.0.linear_attn");
}

TEST_CASE("linear attention sample pinned: finite forward and loss, a healthy scale", "[samples]") {
  TempDir dir;
  auto r = run_sample(AMPDIAG_SAMPLE_LINEAR_ATTENTION, dir.file("la.db"), "--pin-fp32 encoder.0.linear_attn");
  CHECK(first_nonfinite_module(r).empty());
  const auto steps = r.steps();
  for (const auto& s : steps) CHECK(std::isfinite(s.loss));
  CHECK(lowest_scale(steps) >= 128);
  CHECK(steps.back().loss < steps.front().loss);
}

TEST_CASE("camera sample: the projection overflows fp16 in forward", "[samples]") {
  TempDir dir;
  auto r = run_sample(AMPDIAG_SAMPLE_CAMERA, dir.file("cam.db"));
  const auto first = first_nonfinite_module(r);
  REQUIRE(first.count(0) == 1);
  for (const auto& [step, module] : first) CHECK(module == "projection");
  for (const auto& s : r.steps()) CHECK(s.skipped);
}

TEST_CASE("camera sample pinned: no overflow, no skipped step", "[samples]") {
  TempDir dir;
  auto r = run_sample(AMPDIAG_SAMPLE_CAMERA, dir.file("cam.db"), "--pin-fp32 projection");
  CHECK(first_nonfinite_module(r).empty());
  for (const auto& s : r.steps()) CHECK_FALSE(s.skipped);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST_CASE("camera sample with --device cuda: the same diagnosis on a GPU, one line and the CPU without one", "[samples]") {
  TempDir dir;
  const std::string out = dir.file("out.txt"), err = dir.file("err.txt");
  const std::string command = std::string("'") + AMPDIAG_SAMPLE_CAMERA + "' --device cuda --db '" + dir.file("cam.db") +
                              "' > '" + out + "' 2> '" + err + "'";
  REQUIRE(std::system(command.c_str()) == 0);
  const std::string said = read_text(out), warned = read_text(err);
  if (said.find("device: cuda") != std::string::npos) {
    CHECK(warned.empty());
  } else {
    CHECK(said.find("device: cpu") != std::string::npos);
    CHECK(warned.find("no CUDA device here; training on the CPU") != std::string::npos);
    CHECK(std::count(warned.begin(), warned.end(), '\n') == 1);
  }
  // Wherever it ran, the run.db names the projection, with each step's loss scale read back.
  rundb::RunDbReader r(dir.file("cam.db"));
  const auto first = first_nonfinite_module(r);
  REQUIRE(first.count(0) == 1);
  for (const auto& [step, module] : first) CHECK(module == "projection");
  const auto steps = r.steps();
  REQUIRE(steps.size() == 20);
  for (const auto& s : steps) {
    CHECK(s.skipped);
    CHECK(s.found_inf);
    CHECK(s.scale_after == s.scale_before / 2);
  }
}

TEST_CASE("a sample given an unknown module to pin says so and exits 2", "[samples]") {
  const std::string command = std::string("'") + AMPDIAG_SAMPLE_CAMERA + "' --pin-fp32 no.such.module 2> /dev/null";
  const int status = std::system(command.c_str());
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 2);
}
