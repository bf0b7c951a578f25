// A LibTorch loop that throws past its Agent (a local of the training function) stopped:
// the Agent's destructor says so in the run.db (event training-raised, at the step it
// stopped in), so that the report covers the steps before it instead of reading "healthy".
#include "../catch_with_torch.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "../analyzer/rule_checks.h"
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

enum class Caught { kNo, kSkipsTheStep, kRecordsAndRethrows };

// Trains the tiny net with an Agent writing `db`; the forward of step `throw_at` throws
// DataError, after its first probe, and `caught` says what the loop does with it: lets it
// leave the function, skips that step, or gives it to Agent::training_raised() and throws
// it on.
void train_until_thrown(const std::string& db, int throw_at, Caught caught) {
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
    } catch (const DataError& e) {
      if (caught == Caught::kRecordsAndRethrows) agent.training_raised(e);
      if (caught != Caught::kSkipsTheStep) throw;
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

// The tiny net (seed 0), its SGD, a scaler, and options for an Agent writing dir's run.db:
// what a loop that catches an error and gives it to training_raised() starts from.
struct CaughtLoop {
  explicit CaughtLoop(const GradScalerOptions& scaler_options = {})
      : net(seeded()), optimizer(net->parameters(), torch::optim::SGDOptions(0.01)), scaler(scaler_options) {
    options.db_path = dir.file("run.db");
  }
  static TinyNet seeded() {
    torch::manual_seed(0);
    return TinyNet();
  }
  TempDir dir;
  TinyNet net;
  torch::optim::SGD optimizer;
  GradScaler scaler;
  AgentOptions options;
};

}  // namespace

TEST_CASE("an exception that unwinds the training past its Agent is one training-raised event at the step it stopped",
          "[agent][raised]") {
  TempDir dir;
  CHECK_THROWS_AS(train_until_thrown(dir.file("run.db"), 3, Caught::kNo), DataError);
  const auto events = raised_events(dir.file("run.db"));
  REQUIRE(events.size() == 1);
  CHECK(events[0].step == 3);
  CHECK_THAT(events[0].detail, Catch::StartsWith("an exception: the Agent was destroyed while it unwound"));
  CHECK(rundb::RunDbReader(dir.file("run.db")).steps().size() == 3);
}

TEST_CASE("the report of a LibTorch run that an exception stopped says it covers the steps before it",
          "[agent][raised]") {
  TempDir dir;
  CHECK_THROWS_AS(train_until_thrown(dir.file("run.db"), 3, Caught::kNo), DataError);
  const auto report = analyzer::analyze({analyzer::load_run(dir.file("run.db"))});
  REQUIRE_FALSE(report.findings.empty());
  const auto& f = report.findings.front();
  CHECK(f.rule == "training-raised");
  CHECK(f.severity == analyzer::Severity::kWarning);
  CHECK(f.title == "The training raised an exception at step 3 and stopped: this report covers the steps before it");
}

TEST_CASE("an exception the loop catches while its Agent lives is no training-raised event", "[agent][raised]") {
  TempDir dir;
  train_until_thrown(dir.file("run.db"), 3, Caught::kSkipsTheStep);
  CHECK(raised_events(dir.file("run.db")).empty());
  CHECK(rundb::RunDbReader(dir.file("run.db")).steps().size() == 4);
}

TEST_CASE("an exception the loop gives to training_raised is one event with its type and message",
          "[agent][raised]") {
  TempDir dir;
  CHECK_THROWS_AS(train_until_thrown(dir.file("run.db"), 3, Caught::kRecordsAndRethrows), DataError);
  const auto events = raised_events(dir.file("run.db"));
  REQUIRE(events.size() == 1);  // the destructor, unwinding the same exception, adds none
  CHECK(events[0].step == 3);
  CHECK(events[0].detail == "DataError: batch 3 is corrupt");
  const auto report = rule_checks::report_of(dir.file("run.db"));
  const auto* found = rule_checks::find(report, "training-raised");
  REQUIRE(found != nullptr);
  const auto& f = *found;
  CHECK(f.title == "The training raised DataError at step 3 and stopped: this report covers the steps before it");
}

TEST_CASE("clip_grad_norm_'s refusal of NaN/Inf gradients under the scaler, caught and recorded, gets the clip fix",
          "[agent][raised]") {
  CaughtLoop loop;
  auto& [dir, net, optimizer, scaler, options] = loop;
  {
    Agent agent(*net, scaler, options);
    const auto x = torch::randn({8, 16});
    try {
      for (int step = 0; step < 3; ++step) {
        optimizer.zero_grad();
        torch::Tensor loss;
        {
          HalfAutocast autocast;
          const auto h = agent.probe("a", torch::relu(net->a(x)));
          loss = net->c(torch::relu(net->b(h))).to(torch::kFloat).pow(2).mean();
        }
        scaler.scale(loss).backward();
        if (step == 2) net->b->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
        scaler.unscale_(optimizer);
        torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0, 2.0, /*error_if_nonfinite=*/true);
        scaler.step(optimizer);
        scaler.update();
      }
      FAIL("clip_grad_norm_ did not refuse the infinite gradient");
    } catch (const c10::Error& e) {
      agent.training_raised(e);
    }
  }
  const auto events = raised_events(dir.file("run.db"));
  REQUIRE(events.size() == 1);
  CHECK(events[0].step == 2);
  CHECK_THAT(events[0].detail, Catch::StartsWith("c10::Error: The total norm of order 2"));
  CHECK(events[0].detail.find('\n') == std::string::npos);
  const auto report = rule_checks::report_of(dir.file("run.db"));
  const auto* found = rule_checks::find(report, "training-raised");
  REQUIRE(found != nullptr);
  const auto& f = *found;
  CHECK(f.severity == analyzer::Severity::kError);
  REQUIRE_FALSE(f.suggestions.empty());
  CHECK_THAT(f.suggestions[0].summary, Catch::StartsWith("With a GradScaler, leave clip_grad_norm_'s error_if_nonfinite"));
}

TEST_CASE("a half model's refusal by the C++ GradScaler, caught and recorded, is the run's error with the FP32 master "
          "weights fix",
          "[agent][raised]") {
  TempDir dir;
  torch::manual_seed(0);
  TinyNet net;
  net->to(torch::kHalf);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  AgentOptions o;
  o.db_path = dir.file("run.db");
  {
    Agent agent(*net, scaler, o);
    optimizer.zero_grad();
    const auto loss = net->c(torch::relu(net->b(torch::relu(net->a(torch::randn({8, 16}).to(torch::kHalf))))))
                          .to(torch::kFloat).pow(2).mean();
    scaler.scale(loss).backward();
    try {
      scaler.step(optimizer);
      FAIL("the scaler unscaled FP16 gradients");
    } catch (const std::invalid_argument& e) {
      agent.training_raised(e);
    }
  }
  const auto events = raised_events(dir.file("run.db"));
  REQUIRE(events.size() == 1);
  CHECK_THAT(events[0].detail, Catch::StartsWith("std::invalid_argument: GradScaler: Attempting to unscale FP16"));
  // Refused at the first step, as torch's scaler refuses it: the run.db holds no step, and
  // loading it is the error that says why and what fixes it.
  CHECK_THROWS_WITH(rule_checks::report_of(dir.file("run.db")),
                    Catch::Contains("the training raised std::invalid_argument: GradScaler: Attempting to unscale FP16 "
                                    "gradients") &&
                        Catch::Contains("keep the parameters in float32"));
}

TEST_CASE("anomaly detection raising on the scaler's first overflow, caught and recorded, says to turn it off",
          "[agent][raised]") {
  GradScalerOptions so;
  so.init_scale = 1e9;  // the first steps overflow fp16 on purpose: the scaler skips them
  CaughtLoop loop(so);
  auto& [dir, net, optimizer, scaler, options] = loop;
  const bool was = torch::autograd::AnomalyMode::is_enabled();
  torch::autograd::AnomalyMode::set_enabled(true);
  // Its warning prints the forward's C++ stack, which reads like a crash in the test log.
  struct Quiet : c10::WarningHandler {
    void process(const c10::Warning&) override {}
  } quiet;
  {
    const c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    Agent agent(*net, scaler, options);
    try {
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        HalfAutocast autocast;
        const auto h = agent.probe("a", torch::relu(net->a(torch::randn({8, 16}))));
        loss = net->c(torch::relu(net->b(h))).to(torch::kFloat).pow(2).mean();
      }
      scaler.scale(loss).backward();
      FAIL("anomaly detection let the overflowed backward through");
    } catch (const c10::Error& e) {
      agent.training_raised(e);
    }
  }
  torch::autograd::AnomalyMode::set_enabled(was);
  const auto events = raised_events(dir.file("run.db"));
  REQUIRE(events.size() == 1);
  CHECK_THAT(events[0].detail, Catch::Contains("' returned nan values in its "));
  // Raised in the first step's backward: the run.db holds no step, and loading it says why
  // and what fixes it.
  CHECK_THROWS_WITH(rule_checks::report_of(dir.file("run.db")),
                    Catch::Contains("Turn anomaly detection off") && Catch::Contains("with a GradScaler"));
}

namespace {

// One step of the tiny net with its three layers run through agent.forward(); b's forward
// throws DataError where `b_throws`, and an error outside every module follows where
// `then_outside`. The loop gives what reaches it to training_raised(); a DataError from b is
// caught and skipped where `b_caught`.
std::vector<rundb::EventRow> raised_in_events(bool b_throws, bool b_caught, bool then_outside) {
  CaughtLoop loop;
  auto& [dir, net, optimizer, scaler, options] = loop;
  {
    Agent agent(*net, scaler, options);
    const auto x = torch::randn({8, 16});
    const Agent::Forward boom = [](const at::Tensor&) -> at::Tensor { throw DataError("b refused its input"); };
    try {
      for (int step = 0; step < 2; ++step) {
        optimizer.zero_grad();
        torch::Tensor loss;
        try {
          HalfAutocast autocast;
          const auto h = agent.forward("a", net->a, x);
          const auto r = b_throws && step == 0 ? agent.forward_as("b", boom, boom, h) : agent.forward("b", net->b, h);
          loss = agent.forward("c", net->c, r).to(torch::kFloat).pow(2).mean();
        } catch (const DataError&) {
          if (!b_caught) throw;
          continue;
        }
        if (then_outside) throw std::runtime_error("the loss is not a scalar");
        scaler.scale(loss).backward();
        scaler.step(optimizer);
        scaler.update();
      }
    } catch (const std::exception& e) {
      agent.training_raised(e);
    }
  }
  std::vector<rundb::EventRow> found;
  for (const auto& e : rundb::RunDbReader(dir.file("run.db")).events())
    if (e.kind == "training-raised-in") found.push_back(e);
  return found;
}

}  // namespace

TEST_CASE("an exception that leaves a module run through forward() names that module beside training-raised",
          "[agent][raised]") {
  const auto events = raised_in_events(true, false, false);
  REQUIRE(events.size() == 1);
  CHECK(events[0].detail == "b (Linear)");
}

TEST_CASE("an exception raised outside every module names none", "[agent][raised]") {
  CHECK(raised_in_events(false, false, true).empty());
}

TEST_CASE("a module's exception the loop caught in an earlier step is not named for a later one", "[agent][raised]") {
  CHECK(raised_in_events(true, true, true).empty());
}

namespace {

struct LstmNetImpl : torch::nn::Module {
  LstmNetImpl() {
    rnn = register_module("rnn", torch::nn::LSTM(torch::nn::LSTMOptions(16, 32).batch_first(true)));
    out = register_module("out", torch::nn::Linear(32, 1));
  }
  torch::nn::LSTM rnn{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(LstmNet);

}  // namespace

TEST_CASE("oneDNN's refusal of a float16 LSTM run through forward() gets the C++ pin of that module",
          "[agent][raised]") {
  TempDir dir;
  torch::manual_seed(0);
  LstmNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01));
  GradScaler scaler;
  bool refused = false;
  {
    Agent agent(*net, scaler, options_for(dir.file("run.db")));
    const Agent::Forward rnn = [&](const at::Tensor& in) { return std::get<0>(net->rnn->forward(in)); };
    try {
      HalfAutocast autocast;
      const auto h = agent.forward_as("rnn", rnn, rnn, torch::randn({4, 10, 16}));
      const auto loss = agent.forward("out", net->out, h).to(torch::kFloat).pow(2).mean();
      scaler.scale(loss).backward();
    } catch (const std::exception& e) {  // oneDNN's own error type, not c10::Error
      if (std::string(e.what()).find("could not create a primitive descriptor") == std::string::npos) throw;
      refused = true;
      agent.training_raised(e);
    }
  }
  if (!refused) {  // Catch2 2 has no SKIP: said in the log, nothing asserted
    WARN("this CPU's oneDNN runs a float16 LSTM: nothing to check");
    return;
  }
  CHECK(event_details(dir.file("run.db"), "training-raised-in") == std::vector<std::string>{"rnn (LSTM)"});
  CHECK_THROWS_WITH(rule_checks::report_of(dir.file("run.db")),
                    Catch::Contains("no float16 LSTM on this CPU") &&
                        Catch::Contains("run rnn in FP32 (ampdiag::Fp32Pins, ampdiag/pin_fp32.h)"));
}
