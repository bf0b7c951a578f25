// follow.h: read what a run.db gained, in the background, when it changes.
#include "follow.h"

#include <sys/stat.h>

#include "ampdiag/rundb/rows.h"

namespace ampdiag::gui {

RunFollower::RunFollower(std::string path, std::chrono::milliseconds interval) : path_(std::move(path)), interval_(interval) {
  loaded_signature_ = signature();
}

RunFollower::~RunFollower() {
  if (pending_.valid()) pending_.wait();
}

std::string RunFollower::signature() const {
  std::string s;
  for (const char* suffix : {"", "-wal"}) {
    struct stat st {};
    if (::stat((path_ + suffix).c_str(), &st) == 0)
      s += std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + ";";
    else
      s += "-;";
  }
  return s;
}

std::optional<RunFollower::Update> RunFollower::poll(const analyzer::RunCursor& cursor) {
  if (pending_.valid()) {
    if (pending_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return std::nullopt;
    try {
      Update update = pending_.get();
      loaded_signature_ = pending_signature_;
      error_.clear();
      return update;
    } catch (const std::exception& e) {
      loaded_signature_ = pending_signature_;  // try again only once the file changes again
      error_ = e.what();
      return std::nullopt;
    }
  }
  const auto now = std::chrono::steady_clock::now();
  if (now - last_start_ < interval_) return std::nullopt;
  const std::string current = signature();
  if (current == loaded_signature_) return std::nullopt;
  last_start_ = now;
  pending_signature_ = current;
  pending_ = std::async(std::launch::async, [path = path_, cursor] {
    analyzer::LoadOptions options;
    options.allow_unfinished = true;
    options.threads = 1;  // leave the other cores to the training
    Update update;
    if (cursor.started) update.delta = analyzer::read_run_delta(path, cursor, options);
    if (!cursor.started || update.delta.reload) update.whole = analyzer::load_run(path, options);
    return update;
  });
  return std::nullopt;
}

}  // namespace ampdiag::gui
