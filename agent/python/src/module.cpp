// _ampdiag: the Python binding of the agent's engine. Python hands over raw data
// pointers, element counts and dtype codes of tensors it owns, so the extension never
// links libtorch and works with whatever torch is installed. The GIL is released while
// the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampdiag/kernels/cpu_stats.h"
#include "ampdiag/rundb/rows.h"
#include "entry_watches.h"
#include "fp32_gradients.h"
#include "run_paths.h"
#include "sender_watch.h"
#include "session.h"
#include "weight_schedule.h"

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

agent::Device device_of(int type, int index) {
  if (type != 0 && type != 1) throw std::invalid_argument("device type must be 0 (cpu) or 1 (cuda)");
  if (index < 0) throw std::invalid_argument("device index must be >= 0");
  return {agent::DeviceType(type), index};
}

agent::DeviceOutcome device_outcome(std::uintptr_t values, int device_index, std::uintptr_t stream, unsigned fields) {
  if (values == 0) throw std::invalid_argument("the outcome values' data pointer is null");
  agent::DeviceOutcome o;
  o.device = device_of(1, device_index);
  o.stream = reinterpret_cast<void*>(stream);
  o.values = reinterpret_cast<const double*>(values);
  o.fields = fields;
  return o;
}

// The Python adapter over the session core: Python hands over data pointers, element
// counts, dtype codes and devices of tensors it keeps alive for the call.
class Session {
 public:
  Session(bool overwrite, std::size_t queue_capacity, std::int64_t every, std::int64_t context_steps, int threads,
          bool histogram, bool profile, std::int64_t activation_every)
      : session_([&] {
          if (threads < 0) throw std::invalid_argument("threads must be >= 0 (0: torch's threads)");
          agent::SessionOptions o;
          o.overwrite = overwrite;
          o.histogram = histogram;
          o.activation_every = activation_every;
          o.recorder.queue_capacity = queue_capacity;
          o.recorder.every = every;
          o.recorder.context_steps = context_steps;
          o.cpu.threads = threads;
          o.profile = profile;
#ifdef _OPENMP
          if (threads == 0) o.cpu.parallel_for = openmp_parallel_for;
#endif
          return o;
        }()) {}

  void open(const std::string& db_path, std::int64_t rank, std::int64_t world_size, const std::string& run_id) {
    session_.open(db_path, {rank, world_size}, run_id);
  }
  void failed(const std::string& why) { session_.failed(why); }

  // (layer id, whether this call registered it, the name it is recorded under: "2.weight
  // (from step 20)" where it replaced a parameter of that name)
  std::tuple<std::int64_t, bool, std::string> add_layer(
      std::uintptr_t key, const std::string& name, const std::string& module_path, const std::string& module_type,
      const std::string& dtype, const std::string& shape, std::int64_t numel, bool trainable,
      const std::string& source) {
    auto layer = session_.add_layer(key, {name, module_path, module_type, dtype, shape, numel, trainable, source});
    return {layer.id, layer.added, std::move(layer.name)};
  }
  std::int64_t find_layer(std::uintptr_t key) const { return session_.find_layer(key); }
  std::pair<std::int64_t, bool> layer_of(std::uintptr_t key, const std::string& dtype, const std::string& shape, std::int64_t numel) {
    agent::LayerInfo info;
    info.dtype = dtype;
    info.shape = shape;
    info.numel = numel;
    const auto layer = session_.layer_of(key, info);
    return {layer.id, layer.added};
  }

  void write_meta(const std::string& source, const std::string& torch_version, const std::string& device,
                  const std::string& amp_dtype, const std::string& command_line, bool fused_unscale, py::object scaler) {
    agent::RunMeta m;
    m.source = source;
    m.torch_version = torch_version;
    m.device = device;
    m.amp_dtype = amp_dtype;
    m.command_line = command_line;
    m.fused_unscale = fused_unscale;
    m.has_scaler = !scaler.is_none();
    if (m.has_scaler) {
      const auto t = scaler.cast<std::tuple<double, double, double, std::int64_t>>();
      std::tie(m.scaler_init_scale, m.scaler_growth_factor, m.scaler_backoff_factor, m.scaler_growth_interval) = t;
    }
    session_.write_meta(m);
  }

  // Statistics of the gradients (before unscale), staged for this step; with `inv_scale`
  // set (host tensors), also the unscale in place, as
  // torch._amp_foreach_non_finite_check_and_unscale_ writes it; with `device_scale` set
  // (inv_scale and found_inf pointers on the gradients' one device), the same on device.
  // Returns whether a host gradient holds NaN/Inf (device results land later).
  bool grads(const std::vector<std::int64_t>& ids, const std::vector<std::uintptr_t>& ptrs,
             const std::vector<std::int64_t>& numels, const std::vector<int>& dtypes,
             const std::vector<int>& device_types, const std::vector<int>& device_indices,
             const std::vector<std::uintptr_t>& streams, py::object inv_scale, py::object device_scale) {
    const std::size_t n = ids.size();
    if (ptrs.size() != n || numels.size() != n || dtypes.size() != n || device_types.size() != n ||
        device_indices.size() != n || streams.size() != n)
      throw std::invalid_argument("grads(): every per-tensor list must have the same length");
    tensors_.clear();
    for (std::size_t i = 0; i < n; ++i)
      tensors_.push_back({{reinterpret_cast<const void*>(ptrs[i]), numels[i], dtype_code(dtypes[i])},
                          device_of(device_types[i], device_indices[i]), reinterpret_cast<void*>(streams[i])});
    agent::GradBatch b;
    b.layers = ids.data();
    b.tensors = tensors_.data();
    b.count = n;
    if (!inv_scale.is_none()) {
      b.unscale = true;
      b.inv_scale = inv_scale.cast<float>();
    } else if (!device_scale.is_none()) {
      const auto p = device_scale.cast<std::pair<std::uintptr_t, std::uintptr_t>>();
      b.unscale = true;
      b.device_inv_scale = reinterpret_cast<const float*>(p.first);
      b.device_found_inf = reinterpret_cast<float*>(p.second);
    }
    py::gil_scoped_release release;
    return session_.grads(b);
  }

  // Statistics of one module output, staged at the next forward position. Returns whether
  // it holds NaN/Inf (a bool, not the statistics: this runs for every module every step).
  bool activation(std::int64_t module_id, std::uintptr_t ptr, std::int64_t numel, int dtype, int micro_batch,
                  int device_type, int device_index, std::uintptr_t stream) {
    const agent::DeviceTensor t{{reinterpret_cast<const void*>(ptr), numel, dtype_code(dtype)},
                                device_of(device_type, device_index), reinterpret_cast<void*>(stream)};
    py::gil_scoped_release release;
    return session_.activation(module_id, t, micro_batch);
  }

  void weight_norms(const std::vector<std::int64_t>& layers, const std::vector<std::uintptr_t>& ptrs,
                    const std::vector<std::int64_t>& numels, const std::vector<int>& dtypes) {
    const std::size_t n = layers.size();
    if (ptrs.size() != n || numels.size() != n || dtypes.size() != n)
      throw std::invalid_argument("weight_norms: layers, ptrs, numels and dtypes must have the same length");
    std::vector<kernels::TensorRef> refs(n);
    for (std::size_t i = 0; i < n; ++i) refs[i] = {reinterpret_cast<const void*>(ptrs[i]), numels[i], dtype_code(dtypes[i])};
    py::gil_scoped_release release;
    session_.weight_norms(layers.data(), refs.data(), n);
  }

  bool has_nonfinite(std::uintptr_t ptr, std::int64_t numel, int dtype) const {
    const kernels::TensorRef ref{reinterpret_cast<const void*>(ptr), numel, dtype_code(dtype)};
    py::gil_scoped_release release;
    return session_.host_nonfinite(ref);
  }

  std::string engine_for(int device_type, int device_index) const {
    return agent::engine_name(session_.engine_for(device_of(device_type, device_index)));
  }

  void end_step(double loss, std::int64_t losses, double scale_before, double scale_after, bool found_inf, bool skipped,
                std::int64_t python_ns) {
    session_.end_step({loss, losses, scale_before, scale_after, found_inf, skipped}, python_ns);
  }

  // Ends the step with outcome values still on a device (`values`: 4 float64 on
  // device_index, produced on `stream`: loss, scale before, scale after, found_inf); they
  // are copied to the host without waiting and complete the step when they land. `fields`
  // says which of them the step takes (the DeviceOutcome bits); the rest come from here.
  void end_step_on_device(double loss, std::int64_t losses, double scale_before, double scale_after, bool found_inf,
                          bool skipped, std::int64_t python_ns, std::uintptr_t values, int device_index,
                          std::uintptr_t stream, unsigned fields) {
    const agent::DeviceOutcome later = device_outcome(values, device_index, stream, fields);
    session_.end_step({loss, losses, scale_before, scale_after, found_inf, skipped}, python_ns, &later);
  }

  // An update() after the cycle's: the pending step's scale_after, still on the device.
  bool amend_on_device(std::uintptr_t values, int device_index, std::uintptr_t stream) {
    return session_.amend_outcome(device_outcome(values, device_index, stream, agent::DeviceOutcome::kScaleAfter));
  }

  py::dict status() const {
    const auto c = session_.counters();
    py::dict d;
    d["steps"] = c.steps;
    d["rows_written"] = c.rows_written;
    d["dropped"] = c.dropped;
    d["dropped_steps"] = c.dropped_steps;
    d["lost"] = c.lost;
    d["write_errors"] = c.write_errors;
    d["first_error"] = c.first_error;
    return d;
  }

  agent::Session& core() { return session_; }

 private:
  agent::Session session_;
  std::vector<agent::DeviceTensor> tensors_;
};

}  // namespace

PYBIND11_MODULE(_ampdiag, m) {
  m.doc() = "ampdiag's engine: fused gradient statistics, the step recorder and the run.db writer";
  py::register_exception<rundb::RunDbError>(m, "RunDbError", PyExc_OSError);
  m.def("rank_db_path", [](const std::string& path, std::int64_t rank, std::int64_t world_size) {
    return agent::rank_db_path(path, {rank, world_size});
  });
  m.def("built_with_cuda", [] {
#ifdef AMPDIAG_HAVE_CUDA
    return true;
#else
    return false;
#endif
  });
  // DeviceOutcome::Field, for end_step_on_device().
  m.attr("PHASE_FORWARD") = int(rundb::GpuPhase::kForward);
  m.attr("PHASE_BACKWARD") = int(rundb::GpuPhase::kBackward);
  m.attr("PHASE_UNSCALE") = int(rundb::GpuPhase::kUnscale);
  m.attr("PHASE_OPTIMIZER") = int(rundb::GpuPhase::kOptimizer);
  m.attr("KIND_FLOAT32") = int(rundb::GpuKind::kFloat32);
  m.attr("KIND_FLOAT16") = int(rundb::GpuKind::kFloat16);
  m.attr("KIND_BFLOAT16") = int(rundb::GpuKind::kBFloat16);
  m.attr("KIND_OTHER") = int(rundb::GpuKind::kOtherKernel);
  m.attr("OUTCOME_LOSS") = unsigned(agent::DeviceOutcome::kLoss);
  m.attr("OUTCOME_SCALE_BEFORE") = unsigned(agent::DeviceOutcome::kScaleBefore);
  m.attr("OUTCOME_SCALE_AFTER") = unsigned(agent::DeviceOutcome::kScaleAfter);
  m.attr("OUTCOME_FOUND_INF") = unsigned(agent::DeviceOutcome::kFoundInf);
  m.attr("OUTCOME_SKIPPED_IS_FOUND_INF") = unsigned(agent::DeviceOutcome::kSkippedIsFoundInf);
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
  py::class_<agent::WeightSchedule>(m, "WeightSchedule")
      .def(py::init<>())
      .def_static("due", &agent::WeightSchedule::due, py::arg("step"))
      .def("at_start", &agent::WeightSchedule::at_start, py::arg("step"))
      .def("after_skip", &agent::WeightSchedule::after_skip, py::arg("step"));
  py::class_<agent::EntryWatches> entry_watches(m, "EntryWatches");
  entry_watches.def(py::init<>())
      .def_property_readonly("watches",
                             [](const agent::EntryWatches& w) {
                               std::vector<std::pair<std::string, bool>> out;
                               for (const auto& watch : w.watches()) out.emplace_back(watch.path, watch.done);
                               return out;
                             })
      .def(
          "step_ended",
          [](agent::EntryWatches& w, const std::string& named, const std::vector<std::string>& others,
             const std::vector<int>& reached) {
            agent::EntryWatches::Ended e = w.step_ended(named, others, reached);
            std::vector<std::pair<std::string, std::string>> events;
            for (auto& event : e.events) events.emplace_back(std::move(event.kind), std::move(event.detail));
            return std::make_pair(std::move(events), std::move(e.nonfinite));
          },
          py::arg("named"), py::arg("others"), py::arg("reached"),
          "(events as (kind, detail), the named module judged nonfinite or \"\"); reached: per watch, -1 not seen, 0 "
          "finite, 1 NaN/Inf.");
  entry_watches.attr("COMPANIONS") = agent::EntryWatches::kCompanions;
  m.def(
      "fp32_gradients",
      [](std::vector<std::string> ops, std::vector<std::string> received,
         std::vector<std::pair<std::size_t, std::size_t>> edges, std::vector<std::pair<std::size_t, std::string>> parts) {
        agent::GradientGraph graph{std::move(ops), std::move(received), std::move(edges), std::move(parts)};
        return agent::fp32_gradients_detail(agent::fp32_gradient_params(graph));
      },
      py::arg("ops"), py::arg("received"), py::arg("edges"), py::arg("parts"),
      "The fp32-gradients event's detail for a walked graph (agent/core/fp32_gradients.h), \"\" for none: ops and "
      "received per node, edges (node, a node it hands a gradient to), parts (node, parameter).");
  m.attr("FP32_WALK_NODES") = agent::kFp32WalkNodes;
  m.attr("FP32_GRADIENTS") = agent::kFp32GradientsKind;
  py::class_<agent::SenderWatch>(m, "SenderWatch")
      .def(py::init<>())
      .def("arm", &agent::SenderWatch::arm, py::arg("path"))
      .def_property_readonly("armed", &agent::SenderWatch::armed)
      .def_property_readonly("target", &agent::SenderWatch::target)
      .def("user", &agent::SenderWatch::user, py::arg("path"))
      .def(
          "step_ended",
          [](agent::SenderWatch& w, const std::string& named, const std::vector<std::tuple<std::string, int, int>>& calls) {
            std::vector<agent::SenderWatch::Call> seen;
            for (const auto& [path, received, sent] : calls) seen.push_back({path, received, sent});
            return w.step_ended(named, seen);
          },
          py::arg("named"), py::arg("calls"),
          "calls: (path, received: -1/0/1, sent: order or -1); returns the event's detail, \"\" for none.");
  py::class_<Session>(m, "Session")
      .def(py::init<bool, std::size_t, std::int64_t, std::int64_t, int, bool, bool, std::int64_t>(),
           py::arg("overwrite"), py::arg("queue_capacity"), py::arg("every"), py::arg("context_steps"),
           py::arg("threads"), py::arg("histogram"), py::arg("profile") = false, py::arg("activation_every") = 1)
      .def("open", &Session::open, py::arg("db_path"), py::arg("rank"), py::arg("world_size"), py::arg("run_id"))
      .def("failed", &Session::failed)
      .def_property_readonly("opened", [](Session& s) { return s.core().opened(); })
      .def("write_meta", &Session::write_meta)
      .def("set_meta", [](Session& s, const std::string& k, const std::string& v) { s.core().set_meta(k, v); })
      .def("add_layer", &Session::add_layer)
      .def("layers_done", [](Session& s) { s.core().layers_done(); })
      .def("layer_of", &Session::layer_of)
      .def("find_layer", &Session::find_layer)
      .def("module_id", [](Session& s, const std::string& path, const std::string& type, const std::string& source,
                           const std::string& inputs) { return s.core().module_id(path, type, source, inputs); })
      .def("event", [](Session& s, const std::string& kind, const std::string& detail) { s.core().event(kind, detail); })
      .def(
          "event_once",
          [](Session& s, const std::string& key, const std::string& kind, const std::string& detail,
             std::optional<std::int64_t> step) { s.core().event_once(key, kind, detail, step); },
          py::arg("key"), py::arg("kind"), py::arg("detail"), py::arg("step") = py::none())
      .def("add_replay", [](Session& s, const std::string& module, const std::string& outcome, double absmax,
                            const std::string& reason) { s.core().replay(module, outcome, absmax, reason); })
      .def(
          "precision_check",
          [](Session& s, const std::string& module, const std::string& dtype, std::int64_t numel, double rel_error,
             std::int64_t zeroed, double fp32_absmax, std::optional<std::int64_t> step) {
            s.core().precision_check(module, dtype, numel, rel_error, zeroed, fp32_absmax, step);
          },
          py::arg("module"), py::arg("dtype"), py::arg("numel"), py::arg("rel_error"), py::arg("zeroed"),
          py::arg("fp32_absmax"), py::arg("step") = py::none())
      .def(
          "weight_norm",
          [](Session& s, std::int64_t layer, double l2, double absmax, std::optional<std::int64_t> step) {
            s.core().weight_norm(layer, l2, absmax, step);
          },
          py::arg("layer"), py::arg("l2"), py::arg("absmax"), py::arg("step") = py::none())
      .def("weight_norms", &Session::weight_norms, py::arg("layers"), py::arg("ptrs"), py::arg("numels"),
           py::arg("dtypes"), "weight_norm() of contiguous host float32/float16/bfloat16 weights, in one pass.")
      .def("weight_update", [](Session& s, std::int64_t step, std::int64_t layer, std::int64_t nonzero,
                               std::int64_t stalled) { s.core().weight_update(step, layer, nonzero, stalled); })
      .def("backward_began", [](Session& s) { s.core().backward_began(); },
           "A backward is about to run: the layers it reaches take their place in it (arrived())")
      .def("arrived", [](Session& s, std::int64_t layer) { s.core().arrived(layer); })
      .def("arrival", [](Session& s, std::int64_t layer) { return s.core().arrival(layer); },
           "The layer's place in this cycle's backward arrival order; -1: no gradient arrived")
      .def("begin_cycle", [](Session& s) { return s.core().begin_cycle(); })
      .def("add_agent_ns", [](Session& s, std::int64_t ns) { s.core().add_agent_ns(ns); })
      .def("grads", &Session::grads, py::arg("ids"), py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"),
           py::arg("device_types"), py::arg("device_indices"), py::arg("streams"), py::arg("inv_scale") = py::none(),
           py::arg("device_scale") = py::none())
      .def("origin_module", [](Session& s) { return s.core().origin_module(); },
           "The module the last host gradients' first NaN/Inf one names (the innermost holding it and the finite "
           "one before it, unless that holds every layer); \"\" where none held NaN/Inf")
      .def("nonfinite_modules", [](Session& s, std::size_t limit) { return s.core().nonfinite_modules(limit); },
           py::arg("limit"),
           "The modules of the last host gradients' other NaN/Inf ones, in arrival order, each once: not "
           "origin_module() nor inside it")
      .def("activation", &Session::activation)
      .def("has_nonfinite", &Session::has_nonfinite, py::arg("ptr"), py::arg("numel"), py::arg("dtype"),
           "Whether a contiguous host buffer holds NaN/Inf (the activations' check); records nothing.")
      .def_property_readonly("profiling", [](Session& s) { return s.core().profiling(); })
      .def("begin_range",
           [](Session& s, std::int64_t module, int phase, int kind) {
             if (phase < 0 || phase >= rundb::kGpuPhaseCount) throw std::invalid_argument("phase must be a PHASE_* constant");
             if (kind < 0 || kind >= rundb::kGpuKindCount) throw std::invalid_argument("kind must be a KIND_* constant");
             return s.core().begin_range(module, rundb::GpuPhase(phase), rundb::GpuKind(kind));
           })
      .def("end_range", [](Session& s) { s.core().end_range(); })
      .def("engine_for", &Session::engine_for, py::arg("device_type"), py::arg("device_index") = 0)
      .def("end_step", &Session::end_step)
      .def("amend_scale_after", [](Session& s, double v) { return s.core().amend_scale_after(v); })
      .def("end_step_on_device", &Session::end_step_on_device)
      .def("amend_on_device", &Session::amend_on_device)
      .def_property_readonly("step", [](Session& s) { return s.core().step(); })
      .def("close", [](Session& s) { s.core().close(); })
      .def("status", &Session::status);
}
