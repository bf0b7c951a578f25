// A weight under torch.nn.utils.parametrize (spectral_norm, weight_norm, orthogonal) is stored
// as "M.parametrizations.weight.original" in a ParametrizationList that M's forward calls:
// M is the module whose forward uses it, where its gradient overflows and what a pin covers.
#include "rule_test.h"

#include "ampdiag/analyzer/run.h"

namespace {

const std::vector<std::string> kSpectralHead = {"fc.bias", "fc.parametrizations.weight.original"};

// Every step: the forward runs the parametrization and then fc; in backward, the spectral-
// normed weight's gradient is the first to hold Inf.
void spectral_weight_overflows(const std::string& path) {
  RunFixture f(path, kSpectralHead);
  double scale = 65536;
  for (int i = 0; i < 12; ++i, scale /= 2)
    f.activation("fc.parametrizations.weight", false).activation("fc", false).step(
        scale, scale / 2, 1000, {"fc.parametrizations.weight.original"});
  f.finish();
}

}  // namespace

TEST_CASE("a parametrized weight's layer belongs to the module whose forward uses it, with that module's type",
          "[rules][parametrize]") {
  TempDir dir;
  spectral_weight_overflows(dir.file("run.db"));
  const Run run = load_run(dir.file("run.db"));
  CHECK(run.layers[1].info.name == "fc.parametrizations.weight.original");
  CHECK(run.layers[1].info.module_path == "fc");
  CHECK(run.layers[1].info.module_type == "Module");  // fc's, as the modules table has it
  CHECK(run.layers[0].info.module_path == "fc");
}

TEST_CASE("an overflow in a spectral-normed weight's gradient names and pins the module that uses it",
          "[rules][parametrize]") {
  TempDir dir;
  spectral_weight_overflows(dir.file("run.db"));
  const auto r = report_of(dir.file("run.db"));
  const Finding* o = find(r, "overflow-origin");
  REQUIRE(o != nullptr);
  CHECK(o->module == "fc");
  CHECK(o->layer == "fc.parametrizations.weight.original");
  CHECK_THAT(o->suggestions.front().python, Catch::StartsWith("ampdiag.pin_fp32(model.fc)"));
}
