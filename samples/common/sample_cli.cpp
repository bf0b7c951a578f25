// sample_cli.h: argument parsing, autocast scope, run summary.
#include "sample_cli.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>

#include <ATen/ATen.h>
#include <torch/cuda.h>

namespace ampdiag::samples {

namespace {

[[noreturn]] void usage(const SampleInfo& info, int code, const std::string& error = "") {
  FILE* out = code == 0 ? stdout : stderr;
  if (!error.empty()) std::fprintf(out, "%s: %s\n\n", info.name, error.c_str());
  std::fprintf(out,
               "%s: %s\n\n"
               "usage: %s [--db PATH] [--steps N] [--pin-fp32 MODULE]... [--seed N] [--every N] [--histogram]\n"
               "          [--device cpu|cuda|cuda:N]\n\n"
               "  --db PATH          run.db to write (default %s; an existing file is replaced)\n"
               "  --steps N          training steps (default %lld)\n"
               "  --pin-fp32 MODULE  run MODULE with autocast off and fp32 inputs; one of:",
               info.name, info.what, info.name, info.default_db, (long long)info.default_steps);
  for (const auto& m : info.pinnable) std::fprintf(out, " %s", m.c_str());
  std::fprintf(out,
               "\n  --seed N           random seed (default 0)\n"
               "  --every N          record per-layer statistics every N steps (default 1)\n"
               "  --histogram        also record the exponent histograms of gradients and activations\n"
               "  --device DEVICE    train on cpu (default) or cuda[:N]; without a CUDA device, on the CPU\n");
  std::exit(code);
}

std::int64_t parse_int(const SampleInfo& info, const std::string& flag, const char* text, std::int64_t min) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || v < min)
    usage(info, 2, flag + " takes an integer >= " + std::to_string(min) + ", not '" + text + "'");
  return v;
}

c10::Device parse_device(const SampleInfo& info, const std::string& text) {
  const std::string digits = text.rfind("cuda:", 0) == 0 ? text.substr(5) : "";
  const bool indexed = !digits.empty() && digits.size() <= 3 &&
                       std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (text != "cpu" && text != "cuda" && !indexed)
    usage(info, 2, "--device takes cpu, cuda or cuda:N, not '" + text + "'");
  if (text == "cpu") return c10::kCPU;
  const auto index = c10::DeviceIndex(indexed ? std::stoi(digits) : 0);
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "%s: --device %s: no CUDA device here; training on the CPU\n", info.name, text.c_str());
    return c10::kCPU;
  }
  if (std::size_t(index) >= torch::cuda::device_count())
    usage(info, 2, "--device " + text + ": this machine has " + std::to_string(torch::cuda::device_count()) +
                       " CUDA devices");
  return c10::Device(c10::kCUDA, index);
}

}  // namespace

SampleArgs parse_sample_args(int argc, char** argv, const SampleInfo& info) {
  SampleArgs args;
  args.db = info.default_db;
  args.steps = info.default_steps;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage(info, 0);
    if (a == "--histogram") {
      args.histogram = true;
      continue;
    }
    const bool takes_value =
        a == "--db" || a == "--steps" || a == "--pin-fp32" || a == "--seed" || a == "--every" || a == "--device";
    if (!takes_value) usage(info, 2, "unknown argument '" + a + "'");
    if (i + 1 >= argc) usage(info, 2, a + " needs a value");
    const char* v = argv[++i];
    if (a == "--db") {
      args.db = v;
      if (args.db.empty()) usage(info, 2, "--db needs a file name");
    } else if (a == "--steps") {
      args.steps = parse_int(info, a, v, 1);
    } else if (a == "--seed") {
      args.seed = std::uint64_t(parse_int(info, a, v, 0));
    } else if (a == "--every") {
      args.every = parse_int(info, a, v, 1);
    } else if (a == "--device") {
      args.device = parse_device(info, v);
    } else {
      if (std::find(info.pinnable.begin(), info.pinnable.end(), v) == info.pinnable.end())
        usage(info, 2, std::string("--pin-fp32: no module '") + v + "' in this model");
      args.pins.push_back(v);
    }
  }
  return args;
}

AgentOptions agent_options(const SampleArgs& args) {
  AgentOptions o;
  o.db_path = args.db;
  o.overwrite = true;
  o.every = args.every;
  o.histogram = args.histogram;
  o.pinned_fp32 = args.pins;
  return o;
}

Autocast::Autocast(c10::Device device, at::ScalarType dtype)
    : type_(device.type()),
      was_enabled_(at::autocast::is_autocast_enabled(type_)),
      was_dtype_(at::autocast::get_autocast_dtype(type_)) {
  at::autocast::set_autocast_dtype(type_, dtype);
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  // Leaving the outermost autocast region drops its cache of casted weights, as Python does.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, was_enabled_);
  at::autocast::set_autocast_dtype(type_, was_dtype_);
}

void RunSummary::step(const at::Tensor& loss, bool skipped, const GradScaler& scaler) {
  // Copies: the scale tensor changes in place at the next update().
  losses_.push_back(loss.detach().to(at::kDouble));
  const at::Tensor scale = scaler.scale_tensor();
  scales_.push_back(scale.defined() ? scale.to(at::kDouble) : at::ones({}, at::kDouble));
  skipped_ += skipped ? 1 : 0;
}

int exit_with_error(const char* argv0, const std::exception& e) {
  const char* slash = std::strrchr(argv0, '/');
  std::fprintf(stderr, "%s: %s\n", slash ? slash + 1 : argv0, e.what());
  return 2;
}

void RunSummary::print(const SampleInfo& info, const SampleArgs& args, const Agent& agent) const {
  const AgentStatus s = agent.status();
  std::printf("%s: %s\n", info.name, info.what);
  std::printf("  device: %s\n", args.device.str().c_str());
  std::printf("  pinned to fp32: ");
  if (args.pins.empty()) std::printf("nothing");
  for (const auto& p : args.pins) std::printf("%s ", p.c_str());
  const std::int64_t steps = std::int64_t(losses_.size());
  std::printf("\n  steps %lld, skipped %lld", (long long)steps, (long long)skipped_);
  if (steps > 0) {
    const at::Tensor losses = at::stack(losses_).cpu();
    const at::Tensor scales = at::stack(scales_).cpu();
    const std::int64_t nonfinite = steps - losses.isfinite().sum().item<std::int64_t>();
    std::printf(", non-finite losses %lld\n", (long long)nonfinite);
    std::printf("  loss %.4g -> %.4g, loss scale now %g (lowest %g)\n", losses[0].item<double>(),
                losses[steps - 1].item<double>(), scales[steps - 1].item<double>(), scales.min().item<double>());
  } else {
    std::printf("\n");
  }
  std::printf("  run.db: %s (%lld rows, %lld dropped", s.db_path.c_str(), (long long)s.rows_written, (long long)s.dropped);
  if (s.write_errors > 0) std::printf(", %lld lost to a write error: %s", (long long)s.lost, s.first_error.c_str());
  std::printf(")\n");
}

}  // namespace ampdiag::samples
