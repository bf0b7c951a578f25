// Follows a run.db that a training process is still writing (WAL): when the file or its
// WAL changed, it is loaded again in the background, at most once per interval, and the
// window swaps the new Run in when it is ready. The whole file is read again each time
// (issue 10 asks for appending only the new steps; that needs an incremental loader).
#pragma once

#include <chrono>
#include <future>
#include <optional>
#include <string>

#include "ampdiag/analyzer/run.h"

namespace ampdiag::gui {

class RunFollower {
 public:
  explicit RunFollower(std::string path, std::chrono::milliseconds interval = std::chrono::milliseconds(1000));
  ~RunFollower();  // waits for a load in flight

  // Call every frame. Starts a load when the file changed and the interval has passed;
  // returns the loaded Run once one is ready. A load that fails keeps the old Run and
  // leaves its message in error().
  std::optional<analyzer::Run> poll();
  const std::string& error() const { return error_; }

 private:
  std::string signature() const;  // size and mtime of the db and its WAL

  std::string path_, loaded_signature_, error_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point last_start_{};
  std::future<analyzer::Run> pending_;
  std::string pending_signature_;
};

}  // namespace ampdiag::gui
