// sample_cli.h: argument parsing, autocast scope, run summary.
#include "sample_cli.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>

namespace ampdiag::samples {

namespace {

[[noreturn]] void usage(const SampleInfo& info, int code, const std::string& error = "") {
  FILE* out = code == 0 ? stdout : stderr;
  if (!error.empty()) std::fprintf(out, "%s: %s\n\n", info.name, error.c_str());
  std::fprintf(out,
               "%s: %s\n\n"
               "usage: %s [--db PATH] [--steps N] [--pin-fp32 MODULE]... [--seed N] [--every N] [--histogram]\n\n"
               "  --db PATH          run.db to write (default %s; an existing file is replaced)\n"
               "  --steps N          training steps (default %lld)\n"
               "  --pin-fp32 MODULE  run MODULE with autocast off and fp32 inputs; one of:",
               info.name, info.what, info.name, info.default_db, (long long)info.default_steps);
  for (const auto& m : info.pinnable) std::fprintf(out, " %s", m.c_str());
  std::fprintf(out,
               "\n  --seed N           random seed (default 0)\n"
               "  --every N          record per-layer statistics every N steps (default 1)\n"
               "  --histogram        also record the gradients' exponent histograms\n");
  std::exit(code);
}

std::int64_t parse_int(const SampleInfo& info, const std::string& flag, const char* text, std::int64_t min) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || v < min)
    usage(info, 2, flag + " takes an integer >= " + std::to_string(min) + ", not '" + text + "'");
  return v;
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
    const bool takes_value = a == "--db" || a == "--steps" || a == "--pin-fp32" || a == "--seed" || a == "--every";
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
  return o;
}

CpuAutocast::CpuAutocast(at::ScalarType dtype)
    : was_enabled_(at::autocast::is_autocast_enabled(at::kCPU)), was_dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
  at::autocast::set_autocast_dtype(at::kCPU, dtype);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::increment_nesting();
}

CpuAutocast::~CpuAutocast() {
  // Leaving the outermost autocast region drops its cache of casted weights, as Python does.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCPU, was_enabled_);
  at::autocast::set_autocast_dtype(at::kCPU, was_dtype_);
}

void RunSummary::step(double loss, bool skipped, double scale) {
  if (steps_ == 0) {
    first_loss_ = loss;
    min_scale_ = scale;
  }
  ++steps_;
  skipped_ += skipped ? 1 : 0;
  nonfinite_losses_ += std::isfinite(loss) ? 0 : 1;
  last_loss_ = loss;
  last_scale_ = scale;
  min_scale_ = std::min(min_scale_, scale);
}

int exit_with_error(const char* argv0, const std::exception& e) {
  const char* slash = std::strrchr(argv0, '/');
  std::fprintf(stderr, "%s: %s\n", slash ? slash + 1 : argv0, e.what());
  return 2;
}

void RunSummary::print(const SampleInfo& info, const SampleArgs& args, const Agent& agent) const {
  const AgentStatus s = agent.status();
  std::printf("%s: %s\n", info.name, info.what);
  std::printf("  pinned to fp32: ");
  if (args.pins.empty()) std::printf("nothing");
  for (const auto& p : args.pins) std::printf("%s ", p.c_str());
  std::printf("\n  steps %lld, skipped %lld, non-finite losses %lld\n", (long long)steps_, (long long)skipped_,
              (long long)nonfinite_losses_);
  std::printf("  loss %.4g -> %.4g, loss scale now %g (lowest %g)\n", first_loss_, last_loss_, last_scale_, min_scale_);
  std::printf("  run.db: %s (%lld rows, %lld dropped", s.db_path.c_str(), (long long)s.rows_written, (long long)s.dropped);
  if (s.write_errors > 0) std::printf(", %lld lost to a write error: %s", (long long)s.lost, s.first_error.c_str());
  std::printf(")\n");
}

}  // namespace ampdiag::samples
