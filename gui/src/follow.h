// Follows a run.db that a training process is still writing (WAL): when the file or its
// WAL changed, what it gained since the run's cursor is read in the background
// (read_run_delta), at most once per interval, and the window merges it in. A file that
// cannot be read on from the cursor (another run now, rows written below it, no summaries)
// is loaded whole instead.
#pragma once

#include <chrono>
#include <future>
#include <optional>
#include <string>

#include "ampdiag/analyzer/run.h"
#include "ampdiag/analyzer/run_delta.h"

namespace ampdiag::gui {

class RunFollower {
 public:
  // What a read brought: the rows after the cursor, or (`whole` set) the run loaded anew.
  struct Update {
    std::optional<analyzer::Run> whole;
    analyzer::RunDelta delta;
  };

  explicit RunFollower(std::string path, std::chrono::milliseconds interval = std::chrono::milliseconds(1000));
  ~RunFollower();  // waits for a read in flight

  // Call every frame with the cursor of the run shown from this file. Starts a read when
  // the file changed and the interval has passed; returns what it read once it is ready. A
  // read that fails leaves its message in error() and nothing to merge.
  std::optional<Update> poll(const analyzer::RunCursor& cursor);
  const std::string& error() const { return error_; }

 private:
  std::string signature() const;  // size and mtime of the db and its WAL

  std::string path_, loaded_signature_, error_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point last_start_{};
  std::future<Update> pending_;
  std::string pending_signature_;
};

}  // namespace ampdiag::gui
