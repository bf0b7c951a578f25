// oversized-weights: a layer whose weights start at a gain (RMS times the square root of the
// fan-in) far above any standard initialisation's is a warning beside the overflows at or
// after it in forward order, whose findings keep their own fixes, and information where
// nothing overflowed.
#include "rule_test.h"

namespace {

const std::vector<std::string> kNet = {"a.weight", "b.weight", "head.weight", "pos_embedding"};

// Step 0 reads the weights: `layer` at a gain of `gain` ([64, 64]: l2 = 8 * gain), the
// others at 0.3. Then `overflows` steps where b's output goes Inf (modules a, b, head run in
// that order), then healthy ones.
Report run_with(const TempDir& dir, const std::string& layer, double gain, int overflows,
                const std::map<std::string, std::string>& types = {}) {
  RunFixture f(dir.file("run.db"), kNet, 0, 1, "float32", types);
  for (const auto& name : kNet) f.weight_norm(name, name == layer ? 8.0 * gain : 2.4);
  double scale = 65536;
  for (int i = 0; i < overflows; ++i, scale /= 2)
    f.activation("a", false).activation("b", true).activation("head", true).step(scale, scale / 2, 1000, {}, kNaN);
  for (int i = 0; i < 6; ++i) f.activation("a", false).activation("b", false).activation("head", false).step(scale, scale);
  f.finish();
  return report_of(dir.file("run.db"));
}

// head.weight read at a gain of 1000, then 12 skipped steps halving `scale` whose first
// NaN/Inf gradient is a.weight's, every output finite.
void head_oversized_then_a_overflows_in_backward(RunFixture& f, double& scale) {
  for (const auto& name : kNet) f.weight_norm(name, name == "head.weight" ? 8000.0 : 2.4);
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("a", false).activation("b", false).activation("head", false).step(scale, scale / 2, 1000, {"a.weight"});
}

// The report of a run that is only head_oversized_then_a_overflows_in_backward(), its layers
// of the shapes `shapes` where not [64, 64].
Report head_oversized_run(const TempDir& dir, const std::map<std::string, std::vector<std::int64_t>>& shapes = {}) {
  RunFixture f(dir.file("run.db"), kNet, 0, 1, "float32", {}, shapes);
  double scale = 65536;
  head_oversized_then_a_overflows_in_backward(f, scale);
  f.finish();
  return report_of(dir.file("run.db"));
}

// `layer` read at a gain of 1000, then 6 steps whose NaN/Inf the model's own code makes
// between a and b (b only receives it: its FP32 replay is NaN/Inf too), as a VAE's
// exp(0.5 * logvar) between its logvar head and its decoder.
Report own_code_after_a_run(const TempDir& dir, const std::string& layer) {
  RunFixture f(dir.file("run.db"), kNet, 0, 1, "float32");
  for (const auto& name : kNet) f.weight_norm(name, name == layer ? 8000.0 : 2.4);
  f.replay("b", "nonfinite");
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.activation("a", false).activation("b", true).activation("head", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  return report_of(dir.file("run.db"));
}

// `layer` read at a gain of 9590, then 6 steps whose NaN/Inf starts at head, whose FP32
// replay was finite but reached 89850: the forward-nonfinite finding.
Finding head_beyond_range(const TempDir& dir, const std::string& layer) {
  RunFixture f(dir.file("run.db"), kNet, 0, 1, "float32");
  for (const auto& name : kNet) f.weight_norm(name, name == layer ? 8.0 * 9590 : 2.4);
  f.finite_replay("head", 89849.9);
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.activation("a", false).activation("b", false).activation("head", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  return required(r, "forward-nonfinite");
}

}  // namespace

TEST_CASE("weights of the module after which the model's own code overflows explain that overflow",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = own_code_after_a_run(dir, "a.weight");
  const Finding& fw = required(r, "forward-nonfinite");
  REQUIRE(fw.module.empty());
  CHECK_THAT(fw.title, Catch::EndsWith("between a and b"));
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kWarning);
  CHECK(w.title == "a.weight starts at a gain of 1000, far above any standard initialisation's: the overflow in the "
                   "model's own forward() after a likely follows from it");
  CHECK_THAT(w.evidence, Catch::EndsWith("; the model's own forward() after a went NaN/Inf in forward (see "
                                         "forward-nonfinite)"));
  REQUIRE_FALSE(w.suggestions.empty());
}

TEST_CASE("weights of a module after the model's own code that overflowed do not explain it", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = own_code_after_a_run(dir, "head.weight");
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kInfo);
  CHECK_THAT(w.title, Catch::EndsWith("and no overflow follows from it"));
  CHECK(w.suggestions.empty());
}

TEST_CASE("weights starting far above a standard initialisation's gain are named beside the overflow after them",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = run_with(dir, "a.weight", 1000.0, 6);
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kWarning);
  CHECK(w.module == "a");
  CHECK(w.title == "a.weight starts at a gain of 1000, far above any standard initialisation's: the overflow at b "
                   "likely follows from it");
  CHECK_THAT(w.suggestions.front().python, Catch::StartsWith("model.get_submodule(\"a\").reset_parameters()"));
  const Finding& fw = required(r, "forward-nonfinite");  // a gain may be by design: its own fixes stay
  CHECK(fw.severity == Severity::kError);
  CHECK(r.findings.front().rule == "forward-nonfinite");
}

TEST_CASE("weights a parametrization computes are re-initialised through it, not by reset_parameters()",
          "[rules][oversized-weights]") {
  // weight_norm's magnitude 3e4 times too large on a GAN's generator layer: reset_parameters()
  // writes into the weight the parametrization computes, a copy, and the magnitude stays.
  TempDir dir;
  const std::vector<std::string> layers = {"a.parametrizations.weight.original0", "a.parametrizations.weight.original1",
                                           "b.weight", "head.weight"};
  RunFixture f(dir.file("run.db"), layers);
  for (const auto& name : layers) f.weight_norm(name, name == layers.front() ? 8000.0 : 2.4);
  double scale = 65536;
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.activation("a", false).activation("b", true).activation("head", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  const Report r = report_of(dir.file("run.db"));
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.module == "a");
  const Suggestion& fix = w.suggestions.front();
  CHECK_THAT(fix.summary, Catch::Contains("Its weight is computed by a parametrization (weight_norm, spectral_norm) "
                                          "from a.parametrizations.weight's originals"));
  CHECK_THAT(fix.python, Catch::StartsWith("layer = model.get_submodule(\"a\")\nweight = torch.empty_like(layer.weight)"));
  CHECK_THAT(fix.python, Catch::EndsWith("layer.weight = weight  # through the parametrization's right_inverse"));
  CHECK_THAT(fix.python, !Catch::Contains("reset_parameters"));
}

TEST_CASE("a forward overflow after weights that start far too large keeps its own confirmed fixes first",
          "[rules][oversized-weights]") {
  // A gain may be by design (trainable Fourier features): the replay-confirmed pin stays the
  // first fix, and the re-initialisation is the oversized-weights finding's own.
  TempDir dir;
  const Report r = run_with(dir, "a.weight", 1000.0, 6);
  for (const auto& s : required(r, "forward-nonfinite").suggestions) CHECK_THAT(s.summary, !Catch::StartsWith("Initialise"));
}

TEST_CASE("a forward overflow beyond fp16's range even in FP32 from the module's own oversized weights leads with them",
          "[rules][oversized-weights]") {
  // A tied LM head 6e4 times too large: its FP32 output reaches 89850, so no pin of it alone
  // helps, and its weights are the cause; the confirmed fixes stay, for a gain by design.
  TempDir dir;
  const Finding fw = head_beyond_range(dir, "head.weight");
  CHECK(fw.module == "head");
  REQUIRE(fw.suggestions.size() >= 2);
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Initialise head at a standard scale"));
  CHECK_THAT(fw.suggestions[1].summary, Catch::StartsWith("Where that gain is by design, train in bfloat16"));
}

TEST_CASE("a forward overflow beyond fp16's range after another module's oversized weights keeps its own fixes first",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Finding fw = head_beyond_range(dir, "a.weight");
  REQUIRE_FALSE(fw.suggestions.empty());
  CHECK_THAT(fw.suggestions[0].summary, Catch::StartsWith("Train in bfloat16"));
}

TEST_CASE("weights far above a standard initialisation's gain in a run that never overflowed are information",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = run_with(dir, "a.weight", 1000.0, 0);
  CHECK(r.healthy());
  CHECK(required(r, "oversized-weights").suggestions.empty());  // info, with nothing to fix
}

TEST_CASE("an overflow before the oversized layer in forward order is not blamed on it", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = run_with(dir, "head.weight", 1000.0, 6);
  CHECK(required(r, "oversized-weights").severity == Severity::kInfo);
}

TEST_CASE("a backward overflow before the oversized layer is named: its gradient passed back through it",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = head_oversized_run(dir);
  CHECK(required(r, "oversized-weights").title == "head.weight starts at a gain of 1000, far above any standard "
                                                  "initialisation's: the overflow at a likely follows from it");
}

TEST_CASE("weights at a gain a trained or standard layer can have are not oversized", "[rules][oversized-weights]") {
  // GPT-style normal(0, 0.02) on a 16384-wide input is 2.6; a trained layer a few times that.
  TempDir dir;
  const Report r = run_with(dir, "a.weight", 40.0, 6);
  CHECK(find(r, "oversized-weights") == nullptr);
}

TEST_CASE("an embedding's table, which torch initialises at 1 and only looks up, is not oversized",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = run_with(dir, "a.weight", 1000.0, 6, {{"a.weight", "Embedding"}});
  CHECK(find(r, "oversized-weights") == nullptr);
}

namespace {

// a.weight, an Embedding's table, read at a gain of 1000 as a [64, 64] matrix, the same tensor
// as `user`.weight (event shared-parameter), `user` a module of type `user_type`; 6 healthy steps.
Report tied_table_run(const TempDir& dir, const std::string& user, const std::string& user_type) {
  RunFixture f(dir.file("run.db"), kNet, 0, 1, "float32", {{"a.weight", "Embedding"}});
  for (const auto& name : kNet) f.weight_norm(name, name == "a.weight" ? 8000.0 : 2.4);
  f.event("shared-parameter", user + ".weight is the same tensor as layer 0; its statistics are recorded once, under "
                              "that layer");
  f.module_type(user, user_type);
  for (int i = 0; i < 6; ++i) f.activation("a", false).activation("b", false).activation(user, false).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an embedding's table that a Linear head uses as its weight is judged by the head's fan-in",
          "[rules][oversized-weights]") {
  // BART's lm_head holds model.shared's table: 3e4 times its initialisation, a loss of 36000
  // that did not move had been called healthy.
  TempDir dir;
  const Report r = tied_table_run(dir, "lm_head", "Linear");
  const Finding& o = required(r, "oversized-weights");
  CHECK_THAT(o.title, Catch::StartsWith("lm_head.weight (the same tensor as a.weight) starts at a gain of 1000"));
  CHECK(o.module == "lm_head");
  CHECK(o.layer == "a.weight");
}

TEST_CASE("an embedding's table that another embedding shares is not oversized", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = tied_table_run(dir, "decoder.embed_tokens", "Embedding");
  CHECK(find(r, "oversized-weights") == nullptr);
}

TEST_CASE("a position embedding held as a plain parameter, added and not summed over, is not oversized",
          "[rules][oversized-weights]") {
  // vit-pytorch's nn.Parameter(torch.randn(1, 65, dim)): values of 1 over a "fan-in" of 65 * dim.
  TempDir dir;
  const Report r = run_with(dir, "pos_embedding", 1000.0, 6);
  CHECK(find(r, "oversized-weights") == nullptr);
}

TEST_CASE("an occasional overflow that held the scale down is named with the oversized layer as a warning",
          "[rules][oversized-weights]") {
  // A head swapped in at step 30 at a gain of 1000: eight overflows bring the scale from
  // 65536 to 256, within the skip-rate threshold (8 of 80), where scale-collapse speaks.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kNet);
  for (int i = 0; i < 30; ++i) f.step(65536, 65536);
  for (const auto& name : kNet) f.weight_norm(name, name == "head.weight" ? 8000.0 : 2.4);
  double scale = 65536;
  for (int i = 0; i < 8; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"a.weight"});
  for (int i = 0; i < 42; ++i) f.step(scale, scale);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding& origin = required(r, "overflow-origin");
  CHECK(origin.severity == Severity::kInfo);
  CHECK_THAT(origin.evidence, Catch::Contains("the run's skips, 8 of 80 steps, stay within the 10% threshold"));
  CHECK(required(r, "scale-collapse").severity == Severity::kWarning);
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kWarning);
  CHECK(w.title == "head.weight starts at a gain of 1000, far above any standard initialisation's: the occasional "
                   "overflow at a likely follows from it");
}

TEST_CASE("the scaler's calibration skip is not blamed on an oversized layer", "[rules][oversized-weights]") {
  // A healthy run of the same model backs off from 65536 at its first step too.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kNet);
  for (const auto& name : kNet) f.weight_norm(name, name == "head.weight" ? 8000.0 : 2.4);
  f.step(65536, 32768, 1000, {"a.weight"});
  for (int i = 0; i < 20; ++i) f.step(32768, 32768);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kInfo);
  CHECK(w.title == "head.weight starts at a gain of 1000, far above any standard initialisation's, and no overflow "
                   "follows from it");
  CHECK(w.suggestions.empty());
}

TEST_CASE("a calibration far deeper than a healthy run's is put on the oversized layer before its overflow",
          "[rules][oversized-weights]") {
  // Lightning's 16-mixed loop with a weight 3000x its init: nine back-offs from 65536 at the
  // start, all calibration; the same model at its init has none.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kNet);
  for (const auto& name : kNet) f.weight_norm(name, name == "a.weight" ? 8000.0 : 2.4);
  double scale = 65536;
  for (int i = 0; i < 9; ++i, scale /= 2) f.step(scale, scale / 2, 1000, {"head.weight"});
  for (int i = 0; i < 60; ++i) f.step(scale, scale);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  CHECK(r.healthy());
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kInfo);
  CHECK(w.title == "a.weight starts at a gain of 1000, far above any standard initialisation's: the overflows at head "
                   "that brought the loss scale down 9 halvings at the start likely follow from it");
  CHECK_FALSE(w.suggestions.empty());
}

TEST_CASE("a NaN/Inf loss no module output was probed for is put on the oversized layer", "[rules][oversized-weights]") {
  // A LibTorch LM whose head starts 17000 times too large, no module probed: its logits
  // overflow and the loss is NaN, the scale falls 27 halvings; one skip in between whose
  // gradients overflowed first in b is not what brought it down.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kNet);
  for (const auto& name : kNet) f.weight_norm(name, name == "head.weight" ? 8000.0 : 2.4);
  double scale = 65536;
  for (int i = 0; i < 20; ++i, scale /= 2) {
    if (i == 9)
      f.step(scale, scale / 2, 1000, {"b.weight"});
    else
      f.step(scale, scale / 2, 1000, {}, kNaN);
  }
  for (int i = 0; i < 6; ++i) f.step(scale, scale);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kWarning);
  CHECK(w.title == "head.weight starts at a gain of 1000, far above any standard initialisation's: the NaN/Inf loss "
                   "likely follows from it");
  CHECK_THAT(w.evidence, Catch::EndsWith("; the loss went NaN/Inf, and no module output was probed to say where it "
                                         "started (see forward-nonfinite)"));
  CHECK_FALSE(w.suggestions.empty());
}

TEST_CASE("an overflow after an oversized expert first called after the head is blamed on it",
          "[rules][oversized-weights]") {
  // A mixture of experts: experts.3, first routed to at step 2, gets a module id after the
  // head's, though it runs before the head in every forward that takes it.
  TempDir dir;
  const std::vector<std::string> net = {"a.weight", "experts.3.weight", "head.weight"};
  RunFixture f(dir.file("run.db"), net);
  for (const auto& name : net) f.weight_norm(name, name == "experts.3.weight" ? 8000.0 : 2.4);
  double scale = 65536;
  for (int i = 0; i < 2; ++i) f.activation("a", false).activation("head", false).step(scale, scale);
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.activation("a", false).activation("experts.3", false).activation("head", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  const Finding& w = required(r, "oversized-weights");
  CHECK(w.severity == Severity::kWarning);
  CHECK_THAT(w.title, Catch::EndsWith(": the overflow at head likely follows from it"));
}

TEST_CASE("the oversized layer's own forward overflow is named before a backward overflow of equal severity",
          "[rules][oversized-weights]") {
  // A ResNet whose fc starts 1e4 times too large: its logits overflow in forward, and the
  // loss they make overflows the stem's gradients in backward. Both follow from it; its
  // own output is what its gain enlarges.
  TempDir dir;
  RunFixture f(dir.file("run.db"), kNet);
  double scale = 65536;
  head_oversized_then_a_overflows_in_backward(f, scale);
  for (int i = 0; i < 6; ++i, scale /= 2)
    f.activation("a", false).activation("b", false).activation("head", true).step(scale, scale / 2, 1000, {}, kNaN);
  f.finish();
  const auto r = report_of(dir.file("run.db"));
  REQUIRE(required(r, "overflow-origin").severity == required(r, "forward-nonfinite").severity);
  CHECK(required(r, "oversized-weights").title == "head.weight starts at a gain of 1000, far above any standard "
                                                  "initialisation's: the overflow at head likely follows from it");
  CHECK_THAT(required(r, "oversized-weights").evidence, Catch::EndsWith("head went NaN/Inf in forward (see forward-nonfinite)"));
}

TEST_CASE("a small head's weights (64 values) far above a standard gain are named beside the overflow",
          "[rules][oversized-weights]") {
  // Two heads on one backbone: the box regressor, Linear(16, 4), 5000 times too large.
  TempDir dir;
  const Report r = head_oversized_run(dir, {{"head.weight", {4, 16}}});
  CHECK(required(r, "oversized-weights").title == "head.weight starts at a gain of 4000, far above any standard "
                                                  "initialisation's: the overflow at a likely follows from it");
}

TEST_CASE("a matrix of a few values is not judged by its gain", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = head_oversized_run(dir, {{"head.weight", {2, 2}}});
  CHECK(find(r, "oversized-weights") == nullptr);
}

namespace {

// b's weights read at a gain of 1000, its outputs reaching `b_output`; a's at most 0.75 (a
// branch beside b in a residual stream that a norm divides, as Phi's attention beside its
// MLP); a.weight's gradients 5% zero and 81% fp16-subnormal in every step, nothing overflowing.
Report underflow_beside_oversized(const TempDir& dir, double b_output) {
  RunFixture f(dir.file("run.db"), kNet, 0, 1, "float32");
  for (const auto& name : kNet) f.weight_norm(name, name == "b.weight" ? 8000.0 : 2.4);
  f.zeros_fraction("a.weight", 0.05, 0.81);
  for (int i = 0; i < 8; ++i)
    f.activation("a", false, 0.75).activation("b", false, b_output).activation("head", false, 1.0).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("weights whose outputs dwarf an underflowing module's explain its underflow, re-initialised first",
          "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = underflow_beside_oversized(dir, 2442.0);
  const Finding& o = required(r, "oversized-weights");
  CHECK(o.severity == Severity::kWarning);
  CHECK_THAT(o.title, Catch::EndsWith(": the underflow in a.weight likely follows from it"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::EndsWith("Where the gain is by design, the underflow's own fixes apply."));
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, Catch::EndsWith("; b's weights start at a gain of 1000 (see oversized-weights), and its outputs "
                                         "reach 2442, 3256 times a's: summed into a residual stream that a norm then "
                                         "divides, a branch that large shrinks the gradients of everything else the "
                                         "stream carries by about as much"));
  REQUIRE(u.suggestions.size() >= 2);
  CHECK_THAT(u.suggestions[0].summary, Catch::StartsWith("Initialise b at a standard scale"));
  CHECK_THAT(u.suggestions[1].summary, Catch::StartsWith("Let the scale grow"));
}

TEST_CASE("weights whose outputs are not far above an underflowing module's leave its underflow alone", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = underflow_beside_oversized(dir, 40.0);
  const Finding& o = required(r, "oversized-weights");
  CHECK(o.severity == Severity::kInfo);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, !Catch::Contains("see oversized-weights"));
  CHECK_THAT(u.suggestions.front().summary, Catch::StartsWith("Let the scale grow"));
}

namespace {

// a, then a Hugging Face MoE's experts whose stacked gate_up_proj (of shape `shape`, 32768
// values) is read at an RMS of `rms`, then head; 12 skipped steps halving the scale whose
// first NaN/Inf gradient is a.weight's.
Report stacked_experts_run(const TempDir& dir, double rms, const std::vector<std::int64_t>& shape) {
  const std::vector<std::string> layers = {"a.weight", "moe.experts.gate_up_proj", "head.weight"};
  RunFixture f(dir.file("run.db"), layers, 0, 1, "float32", {{"moe.experts.gate_up_proj", "MixtralExperts"}},
               {{"moe.experts.gate_up_proj", shape}});
  f.weight_norm("a.weight", 2.4).weight_norm("head.weight", 2.4);
  f.weight_norm("moe.experts.gate_up_proj", rms * std::sqrt(32768.0));
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("a", false).activation("moe.experts", false).activation("head", false).step(scale, scale / 2, 1000,
                                                                                              {"a.weight"});
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an MoE's stacked experts' weight far above a standard gain is named and re-initialised as a stack",
          "[rules][oversized-weights]") {
  // Phimoe's experts 3e4 times too large had gone unnamed beside the underflows they caused:
  // the stack is not weight-named and has no reset_parameters().
  TempDir dir;
  const Report r = stacked_experts_run(dir, 125.0, {4, 128, 64});
  const Finding& o = required(r, "oversized-weights");
  CHECK(o.title == "moe.experts.gate_up_proj starts at a gain of 1000, far above any standard initialisation's: the "
                   "overflow at a likely follows from it");
  CHECK(o.module == "moe.experts");
  CHECK_THAT(o.evidence, Catch::Contains("(each of its 4 experts' matrices, the fan-in taken as the smaller of their two "
                                         "dimensions, 64)"));
  REQUIRE_FALSE(o.suggestions.empty());
  CHECK_THAT(o.suggestions[0].summary, Catch::StartsWith("Initialise moe.experts.gate_up_proj at a standard scale"));
  CHECK_THAT(o.suggestions[0].python, Catch::Contains("torch.nn.init.normal_(experts.gate_up_proj, std=0.02)"));
  CHECK_THAT(o.suggestions[0].python, !Catch::Contains("reset_parameters"));
}

TEST_CASE("an MoE's stacked experts' weight stored input-first is read with the same fan-in",
          "[rules][oversized-weights]") {
  // Llama 4 stores [experts, in, out]: the smaller dimension is taken either way.
  TempDir dir;
  const Report r = stacked_experts_run(dir, 125.0, {4, 64, 128});
  CHECK_THAT(required(r, "oversized-weights").title, Catch::StartsWith("moe.experts.gate_up_proj starts at a gain of 1000"));
}

TEST_CASE("an MoE's stacked experts' weight at Hugging Face's initialisation is not oversized",
          "[rules][oversized-weights]") {
  TempDir dir;  // normal(0, 0.02), a gain of 0.16 on a fan-in of 64
  const Report r = stacked_experts_run(dir, 0.02, {4, 128, 64});
  CHECK(find(r, "oversized-weights") == nullptr);
}

namespace {

// GPT-2's fused attention projection, c_attn, read at a gain of `gain` ([192, 64]), its own
// gradient 33% exact zeros; its bias [192] 41% zero and 13% fp16-subnormal in every step,
// nothing overflowing.
// `head_gain`: head's, read as the largest where it is above c_attn's.
Report saturated_projection_run(const TempDir& dir, double gain, double head_gain = 0.3) {
  const std::vector<std::string> layers = {"attn.c_attn.weight", "attn.c_attn.bias", "head.weight"};
  RunFixture f(dir.file("run.db"), layers, 0, 1, "float32", {},
               {{"attn.c_attn.weight", {192, 64}}, {"attn.c_attn.bias", {192}}});
  f.weight_norm("attn.c_attn.weight", gain * std::sqrt(192.0)).weight_norm("attn.c_attn.bias", 0.1);
  f.weight_norm("head.weight", head_gain * 8.0);
  f.zeros_fraction("attn.c_attn.weight", 0.33).zeros_fraction("attn.c_attn.bias", 0.41, 0.13);
  for (int i = 0; i < 8; ++i) f.activation("attn.c_attn", false, 400.0).activation("head", false, 1.0).step(65536, 65536);
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("an underflow in the module of weights that saturate what takes their outputs is re-initialised first",
          "[rules][oversized-weights]") {
  // A softmax pushed to 0 and 1 by queries and keys 100 times too large: its gradient is 0
  // or next to it in any precision, so bfloat16 would leave most of these zeros.
  TempDir dir;
  const Report r = saturated_projection_run(dir, 112.0);
  const Finding& u = required(r, "underflow");
  CHECK(u.layer == "attn.c_attn.bias");
  CHECK_THAT(u.evidence, Catch::Contains("; attn.c_attn's weights start at a gain of 112 (see oversized-weights), and "
                                         "33% of their own gradient was exactly zero"));
  REQUIRE(u.suggestions.size() >= 2);
  CHECK_THAT(u.suggestions[0].summary, Catch::StartsWith("Initialise attn.c_attn at a standard scale"));
  CHECK_THAT(required(r, "oversized-weights").evidence,
             Catch::EndsWith("the underflow in attn.c_attn.bias is that saturation's too (see underflow)"));
}

TEST_CASE("an underflow beside weights at a standard gain keeps its own fixes first", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = saturated_projection_run(dir, 1.0);
  CHECK(find(r, "oversized-weights") == nullptr);
  const Finding& u = required(r, "underflow");
  CHECK_THAT(u.evidence, !Catch::Contains("see oversized-weights"));
  CHECK_THAT(u.suggestions.front().summary, !Catch::StartsWith("Initialise"));
}

TEST_CASE("a saturating weight that is not the largest still makes the oversized finding a warning",
          "[rules][oversized-weights]") {
  // The head's larger gain is named first; c_attn's saturation explains the underflow.
  TempDir dir;
  const Report r = saturated_projection_run(dir, 112.0, 500.0);
  const Finding& o = required(r, "oversized-weights");
  CHECK(o.layer == "head.weight");
  CHECK(o.severity == Severity::kWarning);
  CHECK_THAT(o.evidence, Catch::EndsWith("the underflow in attn.c_attn.bias is that saturation's too (see underflow)"));
}

namespace {

// A hand-written LayerNorm, norm, takes the outputs of inp, read at a gain of `gain` ([64,
// 64]), inp's gradient 28% exact zeros; the agent's precision checks found norm's fp16 output
// 98% away from FP32 where `lossy`, and rounding alone where not.
Report norm_after_oversized_run(const TempDir& dir, bool lossy) {
  RunFixture f(dir.file("run.db"), {"inp.weight", "norm.g", "out.weight"});
  f.weight_norm("inp.weight", 8.0 * 175).weight_norm("norm.g", 8.0).weight_norm("out.weight", 2.4);
  f.zeros_fraction("inp.weight", 0.28).event("module-input-from", "norm: inp");
  for (int i = 0; i < 8; ++i) {
    f.activation("inp", false, 500.0).activation("norm", false, 1.0).activation("out", false, 1.0);
    if (i % 2 == 0) f.precision_check("norm", lossy ? 0.98 : 0.0004, lossy ? 300 : 0);
    f.step(65536, 65536);
  }
  f.finish();
  return report_of(dir.file("run.db"));
}

}  // namespace

TEST_CASE("weights whose outputs a norm after them loses to fp16 are named for it, and the norm's finding points back",
          "[rules][oversized-weights]") {
  // A hand-written norm whose x.pow(2) passes 65504 divides by Inf and returns its bias alone:
  // the gradient back through it is 0, not a tanh's or a softmax's saturation.
  TempDir dir;
  const Report r = norm_after_oversized_run(dir, true);
  const Finding& o = required(r, "oversized-weights");
  CHECK_THAT(o.title, Catch::EndsWith("28% of its own gradient was exactly zero, and norm, which takes its outputs, "
                                      "loses its output to float16"));
  CHECK_THAT(o.evidence, Catch::Contains("norm, which takes its outputs, loses its output to float16 on values that many "
                                         "times too large (see precision-loss)") &&
                             !Catch::Contains("a tanh or a softmax"));
  const Finding& p = required(r, "precision-loss");
  CHECK_THAT(p.evidence, Catch::EndsWith("its input comes from inp, whose weights start at a gain of 175 (see "
                                         "oversized-weights)"));
  REQUIRE(p.suggestions.size() == 2);
  CHECK_THAT(p.suggestions[0].summary, Catch::StartsWith("Run norm in FP32"));
  CHECK_THAT(p.suggestions[1].summary, Catch::StartsWith("Or initialise inp at a standard scale"));
}

TEST_CASE("weights whose outputs the norm after them keeps in fp16 are named for saturation", "[rules][oversized-weights]") {
  TempDir dir;
  const Report r = norm_after_oversized_run(dir, false);
  CHECK_THAT(required(r, "oversized-weights").title, Catch::EndsWith("what takes its outputs saturated"));
  CHECK(find(r, "precision-loss") == nullptr);
}
