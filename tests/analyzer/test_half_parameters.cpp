// stalled-updates and half-parameters on run.dbs written through the real writer: the
// shares are the stalled counts over the measured ones, summed over the layer's steps.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/writer.h"
#include "../rundb/temp_dir.h"

using namespace ampdiag;
using analyzer::Finding;
using test::TempDir;

namespace {

struct Layer {
  std::string name, dtype;
  // (nonzero, stalled) per measured step
  std::vector<std::pair<std::int64_t, std::int64_t>> updates;
};

std::string write_run(const TempDir& dir, const std::vector<Layer>& layers, const std::string& amp_dtype = "float16") {
  const auto path = dir.file("run.db");
  rundb::RunDbWriter w(path, false);
  w.set_meta("amp_dtype", amp_dtype);
  w.set_meta("device", "cpu");
  w.set_meta("scaler_enabled", "0");
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    w.add_layer({std::int64_t(i), l.name, l.name.substr(0, l.name.rfind('.')), "Linear", l.dtype, "[100]", 100, true, ""});
  }
  for (std::int64_t s = 0; s < 4; ++s) {
    rundb::StepRow row;
    row.step = s;
    row.loss = 0.5;
    row.losses = 1;
    row.scale_before = row.scale_after = 1.0;
    row.sampled = true;
    row.wall_time = 1.7e9 + double(s);
    w.add_step(row);
    for (std::size_t i = 0; i < layers.size(); ++i)
      if (std::size_t(s) < layers[i].updates.size())
        w.add_weight_update({s, std::int64_t(i), layers[i].updates[std::size_t(s)].first,
                             layers[i].updates[std::size_t(s)].second});
  }
  w.finish();
  return path;
}

std::vector<Finding> findings(const std::string& path, const analyzer::Thresholds& t = {}) {
  return analyzer::analyze({analyzer::load_run(path)}, t).findings;
}

const Finding* find_rule(const std::vector<Finding>& all, const std::string& rule) {
  for (const auto& f : all)
    if (f.rule == rule) return &f;
  return nullptr;
}

}  // namespace

TEST_CASE("layers whose updates mostly round away are flagged, the most stalled elements first", "[rules][weights]") {
  TempDir dir;
  // enc.weight: (97 + 95) / 200 = 96.0 %; head.weight: (60 + 70) / 200 = 65.0 % but fewer
  // elements stalled; enc.bias: 10 / 100 = 10.0 %, under the threshold.
  const auto path = write_run(dir, {{"enc.weight", "float16", {{100, 97}, {100, 95}}},
                                    {"head.weight", "float16", {{100, 60}, {100, 70}}},
                                    {"enc.bias", "float16", {{100, 10}}},
                                    {"norm.weight", "float32", {}}});
  const auto all = findings(path);
  const Finding* f = find_rule(all, "stalled-updates");
  REQUIRE(f != nullptr);
  CHECK(f->severity == analyzer::Severity::kWarning);
  CHECK(f->layer == "enc.weight");
  CHECK(f->module == "enc");
  CHECK_THAT(f->title, Catch::Contains("2 layers") && Catch::Contains("enc.weight kept 96.0 %"));
  CHECK_THAT(f->evidence, Catch::Contains("3 of 4 trainable parameter tensors (300 elements) in float16"));
  CHECK_THAT(f->evidence, Catch::Contains("enc.weight: 96.0 % of 200") && Catch::Contains("head.weight: 65.0 % of 200"));
  CHECK_THAT(f->evidence, !Catch::Contains("enc.bias:"));
  REQUIRE(!f->suggestions.empty());
  CHECK_THAT(f->suggestions.front().python, Catch::Contains("model.float()") && Catch::Contains("GradScaler"));
  CHECK(find_rule(all, "half-parameters") == nullptr);
}

TEST_CASE("a C++ agent's file naming dtypes as c10 does (Half) has its half parameters read as such",
          "[rules][weights]") {
  // The C++ agent wrote "Half" and "Float" before it wrote torch's Python names: the rules
  // compare "float16", and read such a file's fp16 weights as FP32 ones.
  TempDir dir;
  const auto path = write_run(dir, {{"enc.weight", "Half", {{100, 97}, {100, 95}}}, {"norm.weight", "Float", {}}});
  const auto run = analyzer::load_run(path);
  CHECK(run.layers[0].info.dtype == "float16");
  CHECK(run.layers[1].info.dtype == "float32");
  const auto all = findings(path);
  const Finding* f = find_rule(all, "stalled-updates");
  REQUIRE(f != nullptr);
  CHECK(f->layer == "enc.weight");
}

TEST_CASE("a bfloat16 run's FP32 master weights keep bfloat16 autocast and no scaler", "[rules][weights]") {
  // A pure-bf16 fine-tune (model.to(bfloat16), AdamW at 2e-5): switching it to fp16 and a
  // scaler would be another run's fix.
  TempDir dir;
  const auto path = write_run(dir, {{"enc.weight", "bfloat16", {{100, 97}, {100, 95}}}}, "bfloat16");
  const auto all = findings(path);
  const Finding* f = find_rule(all, "stalled-updates");
  REQUIRE(f != nullptr);
  REQUIRE(!f->suggestions.empty());
  CHECK_THAT(f->suggestions.front().python, Catch::Contains("dtype=torch.bfloat16") &&
                                                !Catch::Contains("GradScaler(") && !Catch::Contains("torch.float16"));
  CHECK_THAT(f->suggestions.front().cpp, Catch::Contains("at::kBFloat16") && !Catch::Contains("GradScaler"));
}

TEST_CASE("the stalled threshold decides which layers are flagged", "[rules][weights]") {
  TempDir dir;
  const auto path = write_run(dir, {{"enc.weight", "float16", {{100, 97}}}, {"enc.bias", "float16", {{100, 10}}}});
  analyzer::Thresholds t;
  t.stalled_fraction = 0.05;
  const auto low = findings(path, t);
  const Finding* f = find_rule(low, "stalled-updates");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->title, Catch::Contains("2 layers"));
  t.stalled_fraction = 0.99;
  CHECK(find_rule(findings(path, t), "stalled-updates") == nullptr);
}

TEST_CASE("half-precision parameters whose updates land are one info finding and a healthy run", "[rules][weights]") {
  TempDir dir;
  const auto path = write_run(dir, {{"enc.weight", "bfloat16", {{100, 5}, {100, 15}}}, {"enc.bias", "float32", {}}});
  const auto report = analyzer::analyze({analyzer::load_run(path)});
  CHECK(report.healthy());
  const Finding* f = find_rule(report.findings, "half-parameters");
  REQUIRE(f != nullptr);
  CHECK(f->severity == analyzer::Severity::kInfo);
  CHECK_THAT(f->title, Catch::Contains("1 of 2 parameter tensors in bfloat16"));
  CHECK_THAT(f->evidence, Catch::Contains("on 2 measured steps, 10.0 %"));
}

TEST_CASE("fp32 parameters give no half-precision finding", "[rules][weights]") {
  TempDir dir;
  const auto path = write_run(dir, {{"enc.weight", "float32", {}}});
  const auto all = findings(path);
  CHECK(find_rule(all, "half-parameters") == nullptr);
  CHECK(find_rule(all, "stalled-updates") == nullptr);
}

TEST_CASE("weight_updates naming a layer the file does not hold is refused as damaged", "[rules][weights]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  {
    rundb::RunDbWriter w(path, false);
    rundb::StepRow row;
    row.losses = 1;
    row.scale_before = row.scale_after = 1.0;
    w.add_step(row);
    w.add_weight_update({0, 7, 10, 1});
    w.finish();
  }
  REQUIRE_THROWS_WITH(analyzer::load_run(path), Catch::Contains("weight_updates names layer 7"));
}

TEST_CASE("half-precision parameters no optimizer step updated directly are not called master-less",
          "[rules][weights]") {
  TempDir dir;
  // An optimizer over FP32 master copies: the agent measured nothing on the fp16 tensors.
  const auto path = write_run(dir, {{"enc.weight", "float16", {}}});
  const auto all = findings(path);
  const Finding* f = find_rule(all, "half-parameters");
  REQUIRE(f != nullptr);
  CHECK_THAT(f->title, Catch::Equals("The model holds 1 of 1 parameter tensor in float16"));
  CHECK_THAT(f->evidence, !Catch::Contains("no FP32 master weights") && Catch::Contains("FP32 master copies"));
}
