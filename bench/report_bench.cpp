// `ampdiag report` on a generated run of 10 M gradient-stat rows (20,000 steps x 500
// layers, a few overflow episodes), end to end through the real binary, against a plain
// single-threaded SQLite scan of the same table in the same run.
//
//   ampdiag_report_bench [--steps N] [--layers N] [--reps R] [--keep PATH] [--generate-only]
// --generate-only writes the run to --keep's PATH and stops (bench/gui_frames uses it).
#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "ampdiag/rundb/writer.h"

#ifndef AMPDIAG_CLI
#error "AMPDIAG_CLI must name the ampdiag binary"
#endif

using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void generate(const std::string& path, std::int64_t steps, std::int64_t layers) {
  ampdiag::rundb::RunDbWriter w(path, true);
  w.set_meta("amp_dtype", "float16");
  w.set_meta("device", "cuda:0");
  for (std::int64_t l = 0; l < layers; ++l)
    w.add_layer({l, "blocks." + std::to_string(l / 12) + ".p" + std::to_string(l % 12), "blocks." + std::to_string(l / 12),
                 "Linear", "Float", "[768, 768]", 589824, true, ""});
  double scale = 65536;
  for (std::int64_t s = 0; s < steps; ++s) {
    const bool overflow = s % 997 == 13;  // an overflow episode now and then, in one layer
    ampdiag::rundb::StepRow row;
    row.step = s;
    row.loss = 2.0 / (1.0 + double(s) / 1000.0);
    row.scale_before = scale;
    row.scale_after = overflow ? scale / 2 : (s % 2000 == 1999 ? scale * 2 : scale);
    row.found_inf = row.skipped = overflow;
    row.sampled = true;
    row.wall_time = 1.7e9 + double(s);
    for (std::int64_t l = 0; l < layers; ++l) {
      ampdiag::rundb::GradStatRow g;
      g.step = s;
      g.layer_id = l;
      g.bwd_order = layers - 1 - l;
      const bool bad = overflow && l == 137;
      g.stats = {589824, bad ? 7 : 0, bad ? 3 : 0, 100 + l, l, 1.0 + double((s * 31 + l * 17) % 4096), 1e-6, 50.0};
      w.add_grad_stat(g);
    }
    w.add_step(row);
    scale = row.scale_after;
    if (s % 200 == 199) w.commit();
  }
  w.finish();
}

double plain_scan(const std::string& path) {
  sqlite3* db = nullptr;
  sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, nullptr);
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db, "SELECT step, layer_id, bwd_order, numel, nan, inf, zeros, fp16_subnormal, absmax, amin_nz, l2 "
                     "FROM grad_stats", -1,
                     &st, nullptr);
  const auto t0 = Clock::now();
  double sink = 0;
  while (sqlite3_step(st) == SQLITE_ROW)
    for (int c = 0; c < 11; ++c) sink += sqlite3_column_double(st, c);
  const double t = seconds_since(t0);
  sqlite3_finalize(st);
  sqlite3_close(db);
  if (sink == 42.0) std::puts("");
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t steps = 20000, layers = 500;
  int reps = 3;
  std::string keep;
  bool generate_only = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--generate-only") {
      generate_only = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "ampdiag_report_bench: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--steps") steps = std::atoll(argv[i + 1]);
    else if (a == "--layers") layers = std::atoll(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--keep") keep = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: ampdiag_report_bench [--steps N] [--layers N] [--reps R] [--keep PATH] [--generate-only]\n");
      return 2;
    }
  }
  if (steps < 1 || layers < 1 || reps < 1) {
    std::fprintf(stderr, "ampdiag_report_bench: --steps, --layers and --reps must be positive\n");
    return 2;
  }
  const std::string path = keep.empty() ? (std::filesystem::temp_directory_path() /
                                           ("ampdiag-report-bench-" + std::to_string(::getpid()) + ".db")).string()
                                        : keep;
  if (generate_only && keep.empty()) {
    std::fprintf(stderr, "ampdiag_report_bench: --generate-only needs --keep PATH\n");
    return 2;
  }
  const auto g0 = Clock::now();
  generate(path, steps, layers);
  const double gen = seconds_since(g0);
  if (generate_only) {
    std::printf("%s: %lld steps x %lld layers, generated in %.1f s\n", path.c_str(), (long long)steps, (long long)layers, gen);
    return 0;
  }
  std::vector<double> report, scan;
  const std::string cmd = std::string("'") + AMPDIAG_CLI + "' report '" + path + "' --format json > /dev/null";
  for (int r = 0; r < reps; ++r) {
    scan.push_back(plain_scan(path));
    const auto t0 = Clock::now();
    const int rc = std::system(cmd.c_str());
    report.push_back(seconds_since(t0));
    if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) > 1) {
      std::fprintf(stderr, "ampdiag_report_bench: `ampdiag report` failed\n");
      return 1;
    }
  }
  const double rows = double(steps * layers);
  std::printf("## `ampdiag report` on a generated run\n\n");
  std::printf("%lld steps x %lld layers = %.1f M grad_stats rows, %.0f MB on disk (generated in %.1f s). Medians of %d runs.\n\n",
              (long long)steps, (long long)layers, rows / 1e6, double(std::filesystem::file_size(path)) / 1e6, gen, reps);
  std::printf("| what | seconds | M rows/s |\n|---|---:|---:|\n");
  std::printf("| plain SQLite scan of grad_stats, one thread (baseline) | %.2f | %.1f |\n", median(scan), rows / median(scan) / 1e6);
  std::printf("| `ampdiag report --format json`, end to end | %.2f | %.1f |\n", median(report), rows / median(report) / 1e6);
  std::printf("\nratio report / plain scan: %.2f (budget: <= 0.3, and report <= 2 s)\n", median(report) / median(scan));
  if (keep.empty()) std::filesystem::remove(path);
  return 0;
}
