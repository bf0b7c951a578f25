// make_cupti_source() in a build without CUDA: profiling is unavailable, and says why.
#include "ampdiag/profiler/activity.h"

namespace ampdiag::profiler {

namespace {

class NoCuptiSource final : public ActivitySource {
 public:
  std::string start() override { return "this ampdiag was built without CUDA, so without CUPTI"; }
  void set_recording(bool) override {}
  void push_range(std::uint64_t) override {}
  void pop_range() override {}
  void collect(ActivityBatch&) override {}
  void stop() override {}
  std::string name() const override { return "none"; }
};

}  // namespace

std::unique_ptr<ActivitySource> make_cupti_source() { return std::make_unique<NoCuptiSource>(); }

}  // namespace ampdiag::profiler
