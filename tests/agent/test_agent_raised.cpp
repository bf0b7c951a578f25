// A LibTorch loop that throws past its Agent (a local of the training function) stopped:
// the Agent's destructor says so in the run.db (event training-raised, at the step it
// stopped in), so that the report covers the steps before it instead of reading "healthy".
#include "../catch_with_torch.h"

#include <stdexcept>
#include <string>

#include "../rundb/temp_dir.h"
#include "ampdiag/analyzer/analyze.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/reader.h"
#include "tiny_training.h"

using namespace ampdiag;
using namespace ampdiag::test;

namespace {

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Trains the tiny net with an Agent writing `db`; the forward of step `throw_at` throws
// DataError, after its first probe, and `catch_inside` says whether the loop catches it
// (skipping that step) or lets it leave the function.
void train_until_thrown(const std::string& db, int throw_at, bool catch_inside) {
  torch::manual_seed(0);
  TinyNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = db;
  Agent agent(*net, scaler, o);
  const auto x = torch::randn({8, 16});
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss;
    try {
      HalfAutocast autocast;
      const auto h = agent.probe("a", torch::relu(net->a(x)));
      if (step == throw_at) throw DataError("batch " + std::to_string(step) + " is corrupt");
      loss = net->c(torch::relu(net->b(h))).to(torch::kFloat).pow(2).mean();
    } catch (const DataError&) {
      if (!catch_inside) throw;
      continue;
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
  }
}

std::vector<rundb::EventRow> raised_events(const std::string& db) {
  std::vector<rundb::EventRow> found;
  for (const auto& e : rundb::RunDbReader(db).events())
    if (e.kind == "training-raised") found.push_back(e);
  return found;
}

}  // namespace

TEST_CASE("an exception that unwinds the training past its Agent is one training-raised event at the step it stopped",
          "[agent][raised]") {
  TempDir dir;
  CHECK_THROWS_AS(train_until_thrown(dir.file("run.db"), 3, false), DataError);
  const auto events = raised_events(dir.file("run.db"));
  REQUIRE(events.size() == 1);
  CHECK(events[0].step == 3);
  CHECK_THAT(events[0].detail, Catch::StartsWith("an exception: the Agent was destroyed while it unwound"));
  CHECK(rundb::RunDbReader(dir.file("run.db")).steps().size() == 3);
}

TEST_CASE("the report of a LibTorch run that an exception stopped says it covers the steps before it",
          "[agent][raised]") {
  TempDir dir;
  CHECK_THROWS_AS(train_until_thrown(dir.file("run.db"), 3, false), DataError);
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  REQUIRE_FALSE(report.findings.empty());
  const auto& f = report.findings.front();
  CHECK(f.rule == "training-raised");
  CHECK(f.severity == analyzer::Severity::kWarning);
  CHECK(f.title == "The training raised an exception at step 3 and stopped: this report covers the steps before it");
}

TEST_CASE("an exception the loop catches while its Agent lives is no training-raised event", "[agent][raised]") {
  TempDir dir;
  train_until_thrown(dir.file("run.db"), 3, true);
  CHECK(raised_events(dir.file("run.db")).empty());
  CHECK(rundb::RunDbReader(dir.file("run.db")).steps().size() == 4);
}
