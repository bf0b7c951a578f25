// The agent's writer thread (torch-free): its counts are what the file holds, a write
// failure never reaches the training thread, and what it lost is recorded once space
// returns. Also built with ThreadSanitizer in CI (queue, counters, posted rows).
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <thread>

#include "ampdiag/rundb/reader.h"
#include "ampdiag/rundb/writer.h"
#include "writer_thread.h"
#include "../rundb/child_process.h"
#include "../rundb/temp_dir.h"

using namespace ampdiag;
using agent::Record;
using agent::RecordKind;
using agent::WriterThread;
using test::TempDir;

namespace {

Record grad_record(std::int64_t step, std::int64_t layer) {
  Record r;
  r.kind = RecordKind::kGrad;
  r.step = step;
  r.stat.id = layer;
  r.stat.stats.numel = 4;
  r.stat.stats.absmax = 1.0f;
  return r;
}

Record step_record(std::int64_t step) {
  Record r;
  r.kind = RecordKind::kStep;
  r.step = step;
  r.step_data.outcome.scale_before = r.step_data.outcome.scale_after = 65536.0;
  return r;
}

// Pushes `steps` steps of `layers` gradient records each, as the training thread does;
// returns how many the full queue dropped.
std::int64_t train(WriterThread& w, std::int64_t steps, std::int64_t layers) {
  std::int64_t dropped = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    for (std::int64_t l = 0; l < layers; ++l) dropped += w.push(grad_record(s, l)) ? 0 : 1;
    dropped += w.push(step_record(s)) ? 0 : 1;
  }
  return dropped;
}

std::int64_t rows_in(const std::string& path) {
  rundb::RunDbReader r(path);
  return std::int64_t(r.steps().size() + r.grad_stats().size());
}

}  // namespace

TEST_CASE("the writer thread's rows_written is what the file holds", "[writer]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  auto w = std::make_unique<WriterThread>(std::make_unique<rundb::RunDbWriter>(path, false), 1 << 16);
  for (int l = 0; l < 8; ++l) w->post_layer({l, "layer" + std::to_string(l), "m", "Linear", "Float", "[4]", 4, true, "test"});
  const std::int64_t dropped = train(*w, 2000, 8);
  w->stop();
  REQUIRE(w->write_errors() == 0);
  REQUIRE(w->lost() == 0);
  REQUIRE(w->rows_written() + dropped == 2000 * 9);
  REQUIRE(w->rows_written() == rows_in(path));
}

TEST_CASE("a write failure loses the failed batch and what follows, counts it, and never throws into training", "[writer]") {
  TempDir dir;
  const auto path = dir.file("run.db");
  // In a child: the file-size limit (a full disk) must not outlive the test.
  const int code = test::in_child([&] {
    WriterThread w(std::make_unique<rundb::RunDbWriter>(path, false), 1 << 12);
    test::forbid_file_growth(256 * 1024);
    std::int64_t dropped = 0;
    for (int round = 0; round < 200; ++round) {
      dropped += train(w, 10, 64);  // never throws, whatever the disk does
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (w.write_errors() != 1) return 1;
    // Space returns before the run closes: the file is told what it lost.
    test::allow_file_growth();
    w.stop();
    if (w.rows_written() + w.lost() + dropped != 200 * 10 * 65) return 2;
    if (w.rows_written() != rows_in(path)) return 3;
    const auto meta = rundb::RunDbReader(path).meta();
    if (!meta.count("write_error") || meta.at("lost_records") != std::to_string(w.lost())) return 4;
    return w.lost() > 0 ? 0 : 5;
  });
  REQUIRE(code == 0);
}

namespace {

// Waits (5 s at most) until the writer has taken every queued record.
bool drained(const WriterThread& w) {
  for (int i = 0; i < 5000 && w.queue().size() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return w.queue().size() == 0;
}

}  // namespace

TEST_CASE("an idle writer is woken by a quarter-full queue, not by each record", "[writer]") {
  TempDir dir;
  WriterThread w(std::make_unique<rundb::RunDbWriter>(dir.file("run.db"), false), 64);
  // 15 records, below a quarter of 64: taken when the writer's wait ends, which no push cuts short.
  for (int l = 0; l < 15; ++l) REQUIRE(w.push(grad_record(0, l)));
  REQUIRE(drained(w));
  CHECK(w.early_wakes() == 0);
  // 16 at once wake it. A burst that the end of a wait happens to split is tried again.
  std::int64_t pushed = 15;
  for (int burst = 1; burst <= 20 && w.early_wakes() == 0; ++burst) {
    for (int l = 0; l < 16; ++l, ++pushed) REQUIRE(w.push(grad_record(burst, l)));
    REQUIRE(drained(w));
  }
  CHECK(w.early_wakes() >= 1);
  w.stop();
  CHECK(w.rows_written() == pushed);
}
