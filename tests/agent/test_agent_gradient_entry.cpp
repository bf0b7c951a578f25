// The C++ agent's look at the gradient reaching the module a skipped step names (event
// "module-output-gradient", agent/src/gradient_entries.h), as the Python agent's: NaN/Inf
// that came in through the module's output was made by the code after it.
#include "../catch_with_torch.h"

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

using Code = std::function<torch::Tensor(const torch::Tensor&)>;

torch::Tensor same(const torch::Tensor& h) { return h; }

// 24 steps of TinyNet's a, b and c run through agent.forward() under fp16 autocast, the
// model's own code `after_a` on a's output and `before_c` on what c is given, the loss c's
// output squared (`linear`: c's output) and averaged; the details of the run's events of `kind`.
std::vector<std::string> entries_of(const TempDir& dir, const Code& after_a, const Code& before_c, bool linear = false,
                                    const std::string& kind = "module-output-gradient") {
  tiny_agent_steps(dir.file("run.db"), 24, [&](Agent& agent, TinyNet& net) {
    const auto x = agent.input("x", torch::randn({64, 16}));
    const auto h = after_a(agent.forward("a", net->a, x));
    const auto y = agent.forward("c", net->c, before_c(torch::relu(agent.forward("b", net->b, h))));
    return linear ? y.to(torch::kFloat).mean() : y.to(torch::kFloat).pow(2).mean();
  });
  return event_details(dir.file("run.db"), kind);
}

}  // namespace

TEST_CASE("a gain after a module in the model's code is seen reaching its output's gradient", "[agent][gradient-entry]") {
  // a's output divided, then multiplied by 3000 in fp16: the same values forward, but the
  // product's backward overflows what b's backward sends, and a only receives the Inf.
  // The report then blames the code after a.
  TempDir dir;
  CHECK(entries_of(dir, [](const torch::Tensor& h) { return (h / 3000.0) * 3000.0; }, same) ==
        std::vector<std::string>{"a: nonfinite"});
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  const auto origin = std::find_if(report.findings.begin(), report.findings.end(),
                                   [](const analyzer::Finding& f) { return f.rule == "overflow-origin"; });
  REQUIRE(origin != report.findings.end());
  CHECK(origin->module == "a");
  CHECK_THAT(origin->evidence, Catch::Contains("the gradient reaching a's output already held NaN/Inf, so its own "
                                               "backward received them: the code that uses a's output"));
}

TEST_CASE("a module whose own backward overflows is seen with a finite gradient at its output, twice",
          "[agent][gradient-entry]") {
  // c given values 300 times larger: its weight gradient (its input times the finite
  // gradient a mean loss sends it, summed over the batch) overflows inside its own backward.
  // Judged finite, it is looked at once more from a later skip, and is finite again.
  TempDir dir;
  CHECK(entries_of(dir, same, [](const torch::Tensor& h) { return h * 300.0; }, true) ==
        std::vector<std::string>{"c: finite", "c: finite"});
}

TEST_CASE("modules whose own backward overflows beside the named one's are judged beside it", "[agent][gradient-entry]") {
  // The product's backward sends b (and through it a) 300 times the gradient too, finite at
  // their outputs, and their own backward overflows as well.
  TempDir dir;
  CHECK(entries_of(dir, same, [](const torch::Tensor& h) { return h * 300.0; }, true, "companion-output-gradient") ==
        std::vector<std::string>{"b: finite, beside c", "a: finite, beside c"});
}

TEST_CASE("a module called twice in a step is judged at the call its gradient reaches first", "[agent][gradient-entry]") {
  // b run again on its own output (layer-normalised, then 1000 times smaller), its weights
  // 3000 times too large: its second call's backward multiplies the finite gradient c sends
  // by them and overflows, and its first call's output receives what b made itself. The
  // second call's output is the one to judge; the first's had said the code after b made them.
  TempDir dir;
  bool scaled = false;
  tiny_agent_steps(dir.file("run.db"), 24, [&](Agent& agent, TinyNet& net) {
    if (!scaled) {
      torch::NoGradGuard no_grad;
      net->b->weight.mul_(3000.0);
      scaled = true;
    }
    const auto h = agent.forward("b", net->b, agent.forward("a", net->a, agent.input("x", torch::randn({64, 16}))));
    const auto twice = agent.forward("b", net->b, torch::layer_norm(h, {32}) * 1e-3);
    return agent.forward("c", net->c, twice).to(torch::kFloat).mean();
  });
  const std::vector<std::string> entries = event_details(dir.file("run.db"), "module-output-gradient");
  CHECK(std::count(entries.begin(), entries.end(), "b: finite") > 0);
  CHECK(std::count(entries.begin(), entries.end(), "b: nonfinite") == 0);
}

namespace {

struct TwoProjectionsImpl : torch::nn::Module {
  TwoProjectionsImpl() {
    p = register_module("p", torch::nn::Linear(32, 8));
    q = register_module("q", torch::nn::Linear(32, 8));
  }
  torch::nn::Linear p{nullptr}, q{nullptr};
};
TORCH_MODULE(TwoProjections);

}  // namespace

TEST_CASE("a second module whose own backward overflows in the same skips is judged with the one they name",
          "[agent][gradient-entry]") {
  // p and q both given one input 1000 times too large: each weight gradient (that input
  // times the finite gradient the mean loss sends) overflows in its own backward, in the
  // same steps; neither received the NaN/Inf from the other.
  TempDir dir;
  torch::manual_seed(0);
  TwoProjections net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(1e-6));
  GradScaler scaler;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    for (int step = 0; step < 6; ++step) {
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        HalfAutocast autocast;
        const auto h = agent.input("x", torch::randn({64, 32})) * 1000.0;
        loss = (agent.forward("p", net->p, h) + agent.forward("q", net->q, h)).to(torch::kFloat).mean();
      }
      scaler.scale(loss).backward();
      scaler.step(optimizer);
      scaler.update();
    }
  }
  std::vector<std::string> details;
  for (const auto& e : rundb::RunDbReader(dir.file("run.db")).events())
    if (e.kind == "module-output-gradient" || e.kind == "companion-output-gradient") details.push_back(e.detail);
  // Whichever of the two arrives first in backward is the one the skips name; judged finite,
  // it is looked at once more, its companion already judged beside it.
  CHECK((details == std::vector<std::string>{"p: finite", "q: finite, beside p", "p: finite"} ||
         details == std::vector<std::string>{"q: finite", "p: finite, beside q", "q: finite"}));
}

namespace {

// A detection-style model as tests/scenarios/test_gradient_entry.py's: a classifier and a box
// head on one convolution's pooled features, the box head's weights `box_gain` times too large.
struct TwoHeadsImpl : torch::nn::Module {
  explicit TwoHeadsImpl(double box_gain) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)));
    cls = register_module("cls", torch::nn::Linear(16, 5));
    box = register_module("box", torch::nn::Linear(16, 4));
    torch::NoGradGuard no_grad;
    box->weight.mul_(box_gain);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear cls{nullptr}, box{nullptr};
};
TORCH_MODULE(TwoHeads);

// 30 steps of TwoHeads run through agent.forward() under fp16 autocast into dir's run.db.
void two_heads_steps(const TempDir& dir) {
  torch::manual_seed(0);
  TwoHeads net(5000.0);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  GradScaler scaler;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    amp_steps(30, optimizer, scaler, [&](int) {
      const auto x = agent.input("x", torch::randn({8, 3, 16, 16}));
      const auto labels = torch::randint(0, 5, {8});
      const auto boxes = torch::rand({8, 4}) * 100.0;
      const auto f = torch::relu(agent.forward("conv", net->conv, x)).mean({2, 3});
      const auto logits = agent.forward("cls", net->cls, f).to(torch::kFloat);
      const auto box = agent.forward("box", net->box, f).to(torch::kFloat);
      return torch::nn::functional::cross_entropy(logits, labels) +
             torch::nn::functional::smooth_l1_loss(box, boxes, torch::nn::functional::SmoothL1LossFuncOptions()
                                                                   .reduction(torch::kSum)) / 8.0;
    });
  }
}

}  // namespace

TEST_CASE("of two heads on one output the one whose backward sent the Inf is seen sending it", "[agent][gradient-entry]") {
  // cls's backward runs just before conv's, yet box's sends the Inf: autograd sums the two
  // into conv's output, and each head is given its own view of it to tell them apart.
  TempDir dir;
  two_heads_steps(dir);
  const auto entries = event_details(dir.file("run.db"), "module-output-gradient");
  REQUIRE_FALSE(entries.empty());
  CHECK(entries.front() == "conv: nonfinite");
  CHECK(event_details(dir.file("run.db"), "module-gradient-sender") == std::vector<std::string>{"conv: box"});
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  REQUIRE_FALSE(report.findings.empty());
  const analyzer::Finding& first = report.findings.front();
  CHECK(first.module == "conv");
  CHECK_THAT(first.title, Catch::EndsWith("they reach it through its output: box's backward makes them"));
}
