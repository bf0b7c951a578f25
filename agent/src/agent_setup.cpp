// What the C++ Agent hands its session apart from the tensors (agent_setup.h).
#include "agent_setup.h"

#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <typeinfo>

namespace ampdiag::agent {

namespace {

std::string shape_text(const at::Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

}  // namespace

std::string module_type_name(const torch::nn::Module& m) {
  std::string name = m.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

// c10's messages go on with a backtrace, and a type in an anonymous namespace is the program's.
std::string raised_text(const std::exception& error) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(typeid(error).name(), nullptr, nullptr, &status),
                                                   std::free);
  std::string type = status == 0 && demangled ? demangled.get() : typeid(error).name();
  if (const std::string anonymous = "(anonymous namespace)::"; type.rfind(anonymous, 0) == 0)
    type.erase(0, anonymous.size());
  std::string message = error.what();
  message = message.substr(0, std::min(message.find('\n'), std::size_t(300)));
  while (!message.empty() && message.back() == ' ') message.pop_back();
  return message.empty() ? type : type + ": " + message;
}

std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : raw)
    if (c == '\0') c = ' ';
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

SessionOptions session_options(const AgentOptions& o) {
  if (o.threads < 0) throw std::invalid_argument("AgentOptions.threads must be >= 0 (0: torch's threads)");
  if (o.queue_capacity < 16) throw std::invalid_argument("AgentOptions.queue_capacity must be at least 16 records");
  if (!o.amp_dtype.empty() && o.amp_dtype != "float16" && o.amp_dtype != "bfloat16")
    throw std::invalid_argument("AgentOptions.amp_dtype must be \"float16\", \"bfloat16\" or empty (float16, or what "
                                "autocast runs in at the first probe), not \"" + o.amp_dtype + "\"");
  for (const auto& path : o.pinned_fp32)
    if (path.empty())
      throw std::invalid_argument("AgentOptions.pinned_fp32 holds an empty module path; give the paths the loop "
                                  "passes to probe() and forward() for the modules it runs in FP32");
  SessionOptions s;
  s.overwrite = o.overwrite;
  s.histogram = o.histogram;
  s.activation_every = o.activation_every;
  s.recorder.queue_capacity = o.queue_capacity;
  s.recorder.every = o.every;
  s.recorder.context_steps = o.context_steps;
  s.cpu.threads = o.threads;
  s.profile = o.profile;
  if (o.threads == 0) {
    // torch's intra-op (OpenMP) team: see CpuEngineOptions::parallel_for. This file is
    // compiled with OpenMP, or at::parallel_for would run serially.
    s.cpu.parallel_for = [](std::int64_t count, const std::function<void(std::int64_t)>& task) {
      at::parallel_for(0, count, 1, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) task(i);
      });
    };
  }
  return s;
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    default: return std::string(c10::toString(type));
  }
}

LayerInfo layer_info(const at::Tensor& p) {
  LayerInfo info;
  info.dtype = dtype_name(p.scalar_type());
  info.shape = shape_text(p);
  info.numel = p.numel();
  info.trainable = p.requires_grad();
  return info;
}

}  // namespace ampdiag::agent
