// _ampdiag: the Python binding of the agent's engine. Python hands over raw data
// pointers, element counts and dtype codes of tensors it owns, so the extension never
// links libtorch and works with whatever torch is installed. The GIL is released while
// the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampdiag/kernels/cpu_stats.h"
#include "ampdiag/rundb/writer.h"
#include "run_paths.h"
#include "step_recorder.h"

namespace py = pybind11;
using namespace ampdiag;

namespace {

kernels::DType dtype_code(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  return kernels::DType(code);
}

py::dict stats_dict(const kernels::TensorStats& s) {
  py::dict d;
  d["numel"] = s.numel;
  d["nan"] = s.nan;
  d["inf"] = s.inf;
  d["zeros"] = s.zeros;
  d["fp16_subnormal"] = s.fp16_subnormal;
  d["absmax"] = s.absmax;
  d["amin_nz"] = s.amin_nz;
  d["l2"] = s.l2;
  return d;
}

#ifdef _OPENMP
// The pass runs on the process's OpenMP team, which is torch's (torch is imported first and
// ships libgomp under the usual soname). A pool of our own would fight torch's threads,
// which spin-wait after each parallel region: measured, it gave no speed-up in training.
void openmp_parallel_for(std::int64_t count, const std::function<void(std::int64_t)>& task) {
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t i = 0; i < count; ++i) task(i);
}
#endif

class Session {
 public:
  Session(const std::string& db_path, bool overwrite, std::size_t queue_capacity, std::int64_t every,
          std::int64_t context_steps, int threads, bool histogram)
      : histogram_(histogram), engine_([&] {
          kernels::CpuEngineOptions o;
          if (threads < 0) throw std::invalid_argument("threads must be >= 0 (0: torch's threads)");
          o.threads = threads;
#ifdef _OPENMP
          if (threads == 0) o.parallel_for = openmp_parallel_for;
#endif
          return o;
        }()) {
    (void)agent::SamplingPolicy(every, context_steps);  // validates before the file is created
    auto writer = std::make_unique<rundb::RunDbWriter>(db_path, overwrite);
    recorder_ = std::make_unique<agent::StepRecorder>(std::move(writer), queue_capacity, every, context_steps);
  }

  void set_meta(const std::string& k, const std::string& v) { recorder_->writer().post_meta(k, v); }
  void add_layer(std::int64_t id, const std::string& name, const std::string& module_path, const std::string& module_type,
                 const std::string& dtype, const std::string& shape, std::int64_t numel, bool trainable,
                 const std::string& source) {
    recorder_->writer().post_layer({id, name, module_path, module_type, dtype, shape, numel, trainable, source});
  }
  void add_module(std::int64_t id, const std::string& path, const std::string& type, const std::string& source,
                  const std::string& inputs) {
    recorder_->writer().post_module({id, path, type, source, inputs});
  }
  void add_event(const std::string& kind, const std::string& detail) {
    recorder_->writer().post_event({recorder_->step(), kind, detail, 0.0});
  }
  void add_replay(const std::string& module, const std::string& outcome, double fp32_absmax, const std::string& reason) {
    if (outcome != "finite" && outcome != "nonfinite" && outcome != "unconfirmed")
      throw std::invalid_argument("replay outcome must be finite, nonfinite or unconfirmed");
    recorder_->writer().post_replay({recorder_->step(), module, outcome, fp32_absmax, reason});
  }

  // Statistics of the gradients (before unscale); with `inv_scale` set, also the unscale
  // in place, as torch._amp_foreach_non_finite_check_and_unscale_ writes it. Returns
  // whether any gradient holds NaN/Inf.
  bool grads(const std::vector<std::int64_t>& ids, const std::vector<std::int64_t>& orders,
             const std::vector<std::uintptr_t>& ptrs, const std::vector<std::int64_t>& numels,
             const std::vector<int>& dtypes, py::object inv_scale) {
    const std::size_t n = ids.size();
    if (orders.size() != n || ptrs.size() != n || numels.size() != n || dtypes.size() != n)
      throw std::invalid_argument("grads(): ids, orders, ptrs, numels and dtypes must have the same length");
    const auto t0 = std::chrono::steady_clock::now();
    stats_.resize(n);
    hist_.assign(histogram_ ? n * kernels::kHistBins : 0, 0);
    bool found;
    if (inv_scale.is_none()) {
      refs_.clear();
      for (std::size_t i = 0; i < n; ++i)
        refs_.push_back({reinterpret_cast<const void*>(ptrs[i]), numels[i], dtype_code(dtypes[i])});
      py::gil_scoped_release release;
      found = engine_.compute(refs_.data(), n, stats_.data(), histogram_ ? hist_.data() : nullptr);
    } else {
      const float inv = inv_scale.cast<float>();
      mrefs_.clear();
      for (std::size_t i = 0; i < n; ++i) mrefs_.push_back({reinterpret_cast<void*>(ptrs[i]), numels[i], dtype_code(dtypes[i])});
      py::gil_scoped_release release;
      found = engine_.unscale_and_compute(mrefs_.data(), n, inv, stats_.data(), histogram_ ? hist_.data() : nullptr);
    }
    for (std::size_t i = 0; i < n; ++i)
      recorder_->stage_grad(ids[i], orders[i], stats_[i], histogram_ ? hist_.data() + i * kernels::kHistBins : nullptr);
    agent_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    return found;
  }

  // Statistics of one module output, staged at the next forward position. Returns whether
  // it holds NaN/Inf (a bool, not the statistics: this runs for every module every step).
  bool activation(std::int64_t module_id, std::uintptr_t ptr, std::int64_t numel, int dtype, int micro_batch) {
    const auto t0 = std::chrono::steady_clock::now();
    const kernels::TensorRef ref{reinterpret_cast<const void*>(ptr), numel, dtype_code(dtype)};
    kernels::TensorStats s;
    {
      py::gil_scoped_release release;
      engine_.compute(&ref, 1, &s);
    }
    recorder_->stage_act(module_id, recorder_->next_forward_order(), s, micro_batch);
    agent_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    return s.has_nonfinite();
  }

  void end_step(double loss, std::int64_t losses, double scale_before, double scale_after, bool found_inf, bool skipped,
                std::int64_t step_ns, std::int64_t python_ns) {
    agent::StepOutcome o;
    o.loss = loss;
    o.losses = losses;
    o.scale_before = scale_before;
    o.scale_after = scale_after;
    o.found_inf = found_inf;
    o.skipped = skipped;
    o.step_ns = step_ns;
    o.agent_ns = agent_ns_ + python_ns;
    agent_ns_ = 0;
    recorder_->end_step(o);
  }
  bool amend_scale_after(double scale_after) { return recorder_->amend_scale_after(scale_after); }
  void begin_step() { recorder_->begin_step(); }

  std::int64_t step() const { return recorder_->step(); }
  void close() { recorder_->close(); }
  py::dict status() const {
    const auto c = recorder_->counters();
    py::dict d;
    d["steps"] = c.steps;
    d["rows_written"] = c.rows_written;
    d["dropped"] = c.dropped;
    d["lost"] = c.lost;
    d["write_errors"] = c.write_errors;
    d["first_error"] = c.first_error;
    return d;
  }

 private:
  bool histogram_;
  kernels::CpuStatsEngine engine_;
  std::unique_ptr<agent::StepRecorder> recorder_;
  std::vector<kernels::TensorRef> refs_;
  std::vector<kernels::MutableTensorRef> mrefs_;
  std::vector<kernels::TensorStats> stats_;
  std::vector<std::uint64_t> hist_;
  std::int64_t agent_ns_ = 0;
};

}  // namespace

PYBIND11_MODULE(_ampdiag, m) {
  m.doc() = "ampdiag's engine: fused gradient statistics, the step recorder and the run.db writer";
  py::register_exception<rundb::RunDbError>(m, "RunDbError", PyExc_OSError);
  m.def("rank_db_path", [](const std::string& path, std::int64_t rank, std::int64_t world_size) {
    return agent::rank_db_path(path, {rank, world_size});
  });
  m.def("default_run_id", [](std::int64_t rank, std::int64_t world_size) {
    return agent::default_run_id({rank, world_size});
  });
  m.def("cpu_isa", [] { return std::string(kernels::cpu_isa_name(kernels::best_cpu_isa())); });
  m.def(
      "tensor_stats",
      [](std::uintptr_t ptr, std::int64_t numel, int dtype) {
        kernels::CpuStatsEngine engine(kernels::CpuEngineOptions{nullptr, 1});
        const kernels::TensorRef ref{reinterpret_cast<const void*>(ptr), numel, dtype_code(dtype)};
        kernels::TensorStats s;
        engine.compute(&ref, 1, &s);
        return stats_dict(s);
      },
      "Statistics of one contiguous CPU buffer.");
  py::class_<Session>(m, "Session")
      .def(py::init<const std::string&, bool, std::size_t, std::int64_t, std::int64_t, int, bool>(), py::arg("db_path"),
           py::arg("overwrite"), py::arg("queue_capacity"), py::arg("every"), py::arg("context_steps"), py::arg("threads"),
           py::arg("histogram"))
      .def("set_meta", &Session::set_meta)
      .def("add_layer", &Session::add_layer)
      .def("add_module", &Session::add_module)
      .def("add_event", &Session::add_event)
      .def("add_replay", &Session::add_replay)
      .def("grads", &Session::grads, py::arg("ids"), py::arg("orders"), py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"),
           py::arg("inv_scale") = py::none())
      .def("activation", &Session::activation)
      .def("end_step", &Session::end_step)
      .def("amend_scale_after", &Session::amend_scale_after)
      .def("begin_step", &Session::begin_step)
      .def_property_readonly("step", &Session::step)
      .def("close", &Session::close)
      .def("status", &Session::status);
}
