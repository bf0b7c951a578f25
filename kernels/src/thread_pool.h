// A small persistent worker pool for the CPU kernels: the caller's thread works too, and
// workers sleep between calls instead of being created per call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ampdiag::kernels {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // total, including the calling thread
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }

  // Calls task(i) for every i in [0, count), spread over the threads; returns when all
  // are done. Not reentrant. Tasks must not throw.
  void parallel_for(std::int64_t count, const std::function<void(std::int64_t)>& task);

 private:
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  int busy_ = 0;
  const std::function<void(std::int64_t)>* task_ = nullptr;
  std::int64_t count_ = 0;
  std::atomic<std::int64_t> next_{0};
};

}  // namespace ampdiag::kernels
