// Device activity as the profiler sees it: kernel and copy records with the correlation
// ids that tie them to the launching API call, and the external ids the agent pushed
// around a module or phase (CUPTI's external correlation). Plain data: the CUPTI source
// fills it from CUPTI's buffers, tests fill it by hand.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ampdiag::profiler {

struct KernelActivity {
  std::string name;  // demangled where the runtime's name could be demangled
  std::uint64_t start_ns = 0, end_ns = 0;
  std::uint32_t device = 0, stream = 0;
  std::uint32_t correlation = 0;  // the launch's API call
};

struct CopyActivity {
  std::uint64_t start_ns = 0, end_ns = 0, bytes = 0;
  std::uint32_t device = 0, stream = 0;
  std::uint32_t correlation = 0;
};

// The external id on top of the launching thread's stack when the API call ran.
struct ExternalCorrelation {
  std::uint32_t correlation = 0;
  std::uint64_t external_id = 0;
};

struct ActivityBatch {
  std::vector<KernelActivity> kernels;
  std::vector<CopyActivity> copies;
  std::vector<ExternalCorrelation> externals;

  bool empty() const { return kernels.empty() && copies.empty() && externals.empty(); }
  void append(ActivityBatch&& other);
};

// Where device activity comes from: CUPTI on a GPU, a test's synthetic records elsewhere.
// start() and the range calls run on the threads that launch work; collect() on the
// writer thread, never on the training thread.
class ActivitySource {
 public:
  virtual ~ActivitySource() = default;
  // Starts recording (off until set_recording(true)). Returns "" or, when profiling is
  // unavailable, why: then no other call but stop() follows.
  virtual std::string start() = 0;
  // Records kernels and copies only while on: the agent turns it on for sampled steps.
  virtual void set_recording(bool on) = 0;
  // Pushes / pops an external id on the calling thread's stack: what that thread launches
  // in between carries it.
  virtual void push_range(std::uint64_t external_id) = 0;
  virtual void pop_range() = 0;
  // Moves the records completed so far into `out`.
  virtual void collect(ActivityBatch& out) = 0;
  // Stops recording and completes what is buffered; a later collect() returns it.
  virtual void stop() = 0;
  virtual std::string name() const = 0;
};

// CUPTI's Activity API, loaded at start() (libcupti.so from the process, the CUDA
// toolkit or the loader's path): an agent built with CUDA runs where there is none. In a
// build without CUDA, start() says so.
std::unique_ptr<ActivitySource> make_cupti_source();

}  // namespace ampdiag::profiler
