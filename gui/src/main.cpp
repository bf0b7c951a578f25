// ampdiag-gui: browse a run's loss-scale timeline, its findings and its layers.
//   ampdiag-gui run.db [more.rank*.db] [--size WxH] [--screenshot out.png]
// With --screenshot it renders a few frames in a hidden window, writes the PNG and exits
// (works under xvfb-run with Mesa). With --bench-frames N it draws N frames while zooming
// and panning and prints the load time and frame-time percentiles (docs/PERFORMANCE.md).
// Exit 2 with one line on bad input.
#define GL_GLEXT_PROTOTYPES
#include <GLFW/glfw3.h>
#include <imgui.h>
#include <imgui_impl_glfw.h>
#include <imgui_impl_opengl3.h>
#include <stb_image_write.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/run.h"
#include "ampdiag/rundb/rows.h"
#include "app.h"
#include "follow.h"

namespace {

constexpr const char* kUsage =
    "usage: ampdiag-gui RUN.db [MORE.db ...] [--size WxH] [--select LAYER] [--step N] [--screenshot OUT.png]\n"
    "  --size WxH          window size in pixels (default 1600x1000)\n"
    "  --select LAYER      show this layer in the detail panel (default: the top-ranked)\n"
    "  --step N            mark step N in the plots\n"
    "  --rank N            with several rank files, show rank N (also a menu)\n"
    "  --loss              draw the loss on its own axis in the timeline (also a checkbox)\n"
    "  --underflow         colour the heatmap by the share of zeros and fp16 subnormals (also a switch)\n"
    "  --follow            reload the runs as a training process writes them (also a checkbox)\n"
    "  --after SECONDS     with --screenshot: keep running (and following) this long first\n"
    "  --screenshot F      render offscreen, write a PNG to F and exit\n"
    "  --drop F            as if F were dropped on the window after the first frame (scripts, tests)\n"
    "  --bench-frames N    draw N frames offscreen while zooming and panning, print the load time\n"
    "                      and frame-time percentiles, and exit\n";

using Clock = std::chrono::steady_clock;
const Clock::time_point kStarted = Clock::now();

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct Options {
  std::vector<std::string> dbs, drop;
  int width = 1600, height = 1000;
  std::string screenshot, select;
  long long step = -1, rank = -1, bench_frames = 0;
  bool follow = false, loss = false, underflow = false;
  double after = 0;
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A number in [min, max] from an option's value (`whole`: digits only), or a UsageError
// saying what was wanted.
double number(const std::string& option, const std::string& v, double min, double max, bool whole, const char* what) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= min && x <= max) || (whole && v.find_first_not_of("0123456789") != std::string::npos))
    throw UsageError(option + " wants " + what + ", not '" + v + "'");
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--size") {
      const std::string v = value();
      int w = 0, h = 0;
      char tail = 0;
      if (std::sscanf(v.c_str(), "%dx%d%c", &w, &h, &tail) != 2 || w < 320 || h < 240 || w > 8192 || h > 8192)
        throw UsageError("--size wants WIDTHxHEIGHT between 320x240 and 8192x8192, not '" + v + "'");
      o.width = w, o.height = h;
    } else if (a == "--after") {
      o.after = number(a, value(), 0, 3600, false, "seconds (0 to 3600)");
    } else if (a == "--loss") {
      o.loss = true;
    } else if (a == "--underflow") {
      o.underflow = true;
    } else if (a == "--follow") {
      o.follow = true;
    } else if (a == "--select") {
      o.select = value();
    } else if (a == "--rank") {
      o.rank = (long long)number(a, value(), 0, 1e15, true, "a rank number (0 or more)");
    } else if (a == "--step") {
      o.step = (long long)number(a, value(), 0, 1e15, true, "a step number (0 or more)");
    } else if (a == "--bench-frames") {
      o.bench_frames = (long long)number(a, value(), 1, 1e6, true, "a number of frames (1 to 1000000)");
    } else if (a == "--drop") {
      o.drop.push_back(value());
    } else if (a == "--screenshot") {
      o.screenshot = value();
    } else if (a.rfind("-", 0) == 0) {
      throw UsageError("unknown option " + a + " (see --help)");
    } else {
      o.dbs.push_back(a);
    }
  }
  if (o.dbs.empty()) throw UsageError("give a run.db (see --help)");
  if (o.after > 0 && o.screenshot.empty()) throw UsageError("--after goes with --screenshot");
  if (o.bench_frames > 0 && (!o.screenshot.empty() || o.follow))
    throw UsageError("--bench-frames goes without --screenshot and --follow");
  return o;
}

// The back buffer as a PNG, top row first.
void write_png(const std::string& path, int w, int h) {
  std::vector<unsigned char> pixels(std::size_t(w) * std::size_t(h) * 3);
  glPixelStorei(GL_PACK_ALIGNMENT, 1);
  glReadBuffer(GL_BACK);
  glReadPixels(0, 0, w, h, GL_RGB, GL_UNSIGNED_BYTE, pixels.data());
  std::vector<unsigned char> flipped(pixels.size());
  const std::size_t row = std::size_t(w) * 3;
  for (int y = 0; y < h; ++y)
    std::copy_n(pixels.data() + std::size_t(h - 1 - y) * row, row, flipped.data() + std::size_t(y) * row);
  // Unfiltered rows: a little larger, and any test can read the pixels back with zlib alone.
  stbi_write_force_png_filter = 0;
  if (!stbi_write_png(path.c_str(), w, h, 3, flipped.data(), int(row)))
    throw std::runtime_error(path + ": cannot write the screenshot");
}

// The view of bench frame i: 40 frames zooming in around the middle, 40 panning, 40
// zooming out, over and over; the first frame shows the whole run.
void bench_view(ampdiag::gui::App& app, long long i, double all_first, double all_last) {
  const long long phase = i % 120;
  const double first = app.view_first(), last = app.view_last(), span = last - first, mid = (first + last) / 2;
  if (i == 0) app.set_view(all_first, all_last);
  else if (phase < 40) app.set_view(mid - span * 0.85 / 2, mid + span * 0.85 / 2);
  else if (phase < 80) app.set_view(first + span * 0.02, last + span * 0.02);
  else app.set_view(mid - span / 0.85 / 2, mid + span / 0.85 / 2);
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[std::min(v.size() - 1, std::size_t(p * double(v.size())))];
}

// What one live update costs with --follow when the file gained nothing: the read in the
// background, then the merge and the rules again on the window's thread.
void bench_live_update(ampdiag::gui::App& app) {
  ampdiag::analyzer::LoadOptions options;
  options.allow_unfinished = true;
  options.threads = 1;
  const auto t0 = Clock::now();
  auto delta = ampdiag::analyzer::read_run_delta(app.paths().front(), app.cursor(0), options);
  const double read_ms = ms_since(t0);
  const bool reload = delta.reload;
  const auto t1 = Clock::now();
  if (!reload) app.merge_run(0, std::move(delta));
  const double merge_ms = ms_since(t1);
  const auto t2 = Clock::now();
  app.poll_analysis(true);
  std::printf("a live update (--follow) with nothing new: read %.1f ms, then rules and ranking %.1f ms, in the background; "
              "merge %.1f ms in the window%s\n",
              read_ms, ms_since(t2), merge_ms, reload ? " (not merged: the file asks for a whole load)" : "");
}

void print_bench(const Options& o, const ampdiag::analyzer::Run& run, double load_ms, double first_frame_ms,
                 const std::vector<double>& frames, const std::vector<double>& whole) {
  auto pct = [&](double p) { return percentile(frames, p); };
  std::printf("ampdiag-gui bench: %s: %zu steps x %zu layers, %.1f M gradient rows\n",
              ampdiag::analyzer::printable(o.dbs.front()).c_str(), run.steps.size(), run.layers.size(), double(run.grad_rows) / 1e6);
  std::printf("load and analysis: %.2f s; first frame drawn %.2f s after start\n", load_ms / 1e3, first_frame_ms / 1e3);
  std::printf("%zu frames at %dx%d while zooming and panning (ms, rendering included): median %.1f, p90 %.1f, p99 %.1f, max %.1f\n",
              frames.size(), o.width, o.height, pct(0.5), pct(0.9), pct(0.99), pct(1.0));
  std::printf("of which %zu show the whole run: median %.1f, max %.1f\n", whole.size(), percentile(whole, 0.5), percentile(whole, 1.0));
}

int run(const Options& o) {
  ampdiag::gui::App app(o.dbs);
  const double load_ms = ms_since(kStarted);
  if (o.rank >= 0 && !app.show_rank(o.rank))
    throw UsageError("--rank: none of the files given is rank " + std::to_string(o.rank));
  if (!o.select.empty() && !app.select(o.select, o.step))
    throw UsageError("--select: no layer named '" + o.select + "' in " + o.dbs.front() + " (ampdiag layers lists them)");
  if (o.select.empty() && o.step >= 0) app.select(app.selected_layer(), o.step);
  app.set_following(o.follow);
  app.set_show_loss(o.loss);
  app.set_heat_underflow(o.underflow);
  std::vector<std::unique_ptr<ampdiag::gui::RunFollower>> followers;
  int followed_generation = -1;

  glfwSetErrorCallback([](int, const char* what) { std::fprintf(stderr, "ampdiag-gui: GLFW: %s\n", what); });
  if (!glfwInit()) throw std::runtime_error("cannot open a window (no display? run under xvfb-run)");
  glfwWindowHint(GLFW_CONTEXT_VERSION_MAJOR, 3);
  glfwWindowHint(GLFW_CONTEXT_VERSION_MINOR, 3);
  glfwWindowHint(GLFW_OPENGL_PROFILE, GLFW_OPENGL_CORE_PROFILE);
  const bool offscreen = !o.screenshot.empty() || o.bench_frames > 0;
  if (offscreen) glfwWindowHint(GLFW_VISIBLE, GLFW_FALSE);
  GLFWwindow* window = glfwCreateWindow(o.width, o.height, "ampdiag", nullptr, nullptr);
  if (!window) {
    glfwTerminate();
    throw std::runtime_error("cannot create an OpenGL 3.3 window (no display? run under xvfb-run)");
  }
  glfwMakeContextCurrent(window);
  // Files dropped on the window are opened at the next frame, not inside GLFW's callback.
  std::vector<std::string> dropped = o.drop;
  glfwSetWindowUserPointer(window, &dropped);
  glfwSetDropCallback(window, [](GLFWwindow* w, int count, const char** paths) {
    auto& pending = *static_cast<std::vector<std::string>*>(glfwGetWindowUserPointer(w));
    pending.assign(paths, paths + count);
  });
  glfwSwapInterval(offscreen ? 0 : 1);
  ImGui::CreateContext();
  ImGui::GetIO().IniFilename = nullptr;  // the layout is the program's, not a file's
  ImGui::StyleColorsDark();
  ImGui_ImplGlfw_InitForOpenGL(window, true);
  ImGui_ImplOpenGL3_Init("#version 330");

  // A screenshot needs a few frames: ImGui sizes windows and tables from the last one.
  int frames = 0;
  std::vector<double> frame_ms, whole_ms;  // every frame; those showing the whole run
  double first_frame_ms = 0;
  const double all_first = app.view_first(), all_last = app.view_last();
  while (!glfwWindowShouldClose(window)) {
    const auto frame_start = Clock::now();
    if (o.bench_frames > 0) bench_view(app, (long long)frame_ms.size(), all_first, all_last);
    // Live: wait for input or the next reload check, not a busy loop.
    if (!offscreen) glfwWaitEventsTimeout(app.following() ? 0.25 : 1.0);
    else if (o.after > 0) glfwWaitEventsTimeout(0.05);
    glfwPollEvents();
    if (!dropped.empty() && (frames > 0 || o.screenshot.empty())) {
      app.open(dropped);
      dropped.clear();
    }
    if (app.quit_requested()) break;
    if (app.generation() != followed_generation) {  // follow the files shown now
      followers.clear();
      for (const auto& path : app.paths()) followers.push_back(std::make_unique<ampdiag::gui::RunFollower>(path));
      followed_generation = app.generation();
    }
    if (app.following() && !app.busy())  // a merge waits for the rules still running on the last one
      for (std::size_t i = 0; i < followers.size(); ++i) {
        if (auto update = followers[i]->poll(app.cursor(i))) {
          if (update->whole) app.replace_run(i, std::move(*update->whole));
          else app.merge_run(i, std::move(update->delta));
        }
        if (i == 0) app.set_follow_error(followers[i]->error());
      }
    ImGui_ImplOpenGL3_NewFrame();
    ImGui_ImplGlfw_NewFrame();
    ImGui::NewFrame();
    int fw = 0, fh = 0;
    glfwGetFramebufferSize(window, &fw, &fh);
    app.frame(float(fw), float(fh));
    ImGui::Render();
    glViewport(0, 0, fw, fh);
    glClearColor(0.08f, 0.08f, 0.1f, 1);
    glClear(GL_COLOR_BUFFER_BIT);
    ImGui_ImplOpenGL3_RenderDrawData(ImGui::GetDrawData());
    if (o.bench_frames > 0) {
      glFinish();  // llvmpipe renders on the CPU: the frame is not done until it has
      frame_ms.push_back(ms_since(frame_start));
      if (app.view_first() <= all_first && app.view_last() >= all_last) whole_ms.push_back(frame_ms.back());
      if (frame_ms.size() == 1) first_frame_ms = ms_since(kStarted);
      if ((long long)frame_ms.size() == o.bench_frames) {
        print_bench(o, app.shown_run(), load_ms, first_frame_ms, frame_ms, whole_ms);
        bench_live_update(app);
        break;
      }
    }
    ++frames;
    if (!o.screenshot.empty() && frames >= 5 && dropped.empty() && glfwGetTime() >= o.after) {
      write_png(o.screenshot, fw, fh);
      const auto& g = app.timeline_geometry();
      std::printf("timeline plot: x0=%.1f y0=%.1f x1=%.1f y1=%.1f first_step=%lld last_step=%lld\n", g.x0, g.y0, g.x1, g.y1,
                  g.first, g.last);
      const auto& hm = app.heatmap_geometry();
      std::printf("heatmap plot: x0=%.1f y0=%.1f x1=%.1f y1=%.1f first_step=%lld last_step=%lld row_height=%.1f top_row=%s\n",
                  hm.x0, hm.y0, hm.x1, hm.y1, hm.first, hm.last, hm.row_height,
                  ampdiag::analyzer::printable(app.top_layer()).c_str());
      std::printf("heatmap-title: %s\n", app.heatmap_title().c_str());
      const auto& d = app.detail_geometry();
      std::printf("shown rank: rank=%lld\n", app.shown_rank());
      const auto& hg = app.histogram_geometry();
      std::printf("histogram plot: x0=%.1f y0=%.1f x1=%.1f y1=%.1f step=%lld\n", hg.x0, hg.y0, hg.x1, hg.y1, hg.first);
      std::string files;
      for (const auto& path : app.paths()) files += (files.empty() ? "" : " ") + ampdiag::analyzer::printable(path);
      std::printf("files shown: %s\n", files.c_str());
      if (app.following()) std::printf("live updates: merged=%d whole=%d\n", app.merged_updates(), app.whole_loads());
      long long skipped = 0;
      for (const auto& s : app.shown_run().steps) skipped += s.row.skipped;
      std::printf("steps shown: count=%zu skipped=%lld\n", app.shown_run().steps.size(), skipped);
      std::string columns;
      for (const char* name : app.layer_columns()) columns += std::string(columns.empty() ? "" : "|") + name;
      std::printf("layers columns: %s\n", columns.c_str());
      if (!app.whatif().empty())
        std::printf("what-if: %s\n", ampdiag::analyzer::printable(app.whatif().front()).c_str());
      if (!app.open_error().empty()) std::printf("open error: %s\n", ampdiag::analyzer::printable(app.open_error()).c_str());
      std::printf("detail plot: x0=%.1f y0=%.1f x1=%.1f y1=%.1f first_step=%lld last_step=%lld layer=%s\n", d.x0, d.y0, d.x1,
                  d.y1, d.first, d.last, ampdiag::analyzer::printable(app.selected_layer()).c_str());
      break;
    }
    glfwSwapBuffers(window);
  }
  ImGui_ImplOpenGL3_Shutdown();
  ImGui_ImplGlfw_Shutdown();
  ImGui::DestroyContext();
  glfwDestroyWindow(window);
  glfwTerminate();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "ampdiag-gui: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ampdiag-gui: %s\n", ampdiag::analyzer::printable(e.what(), true).c_str());
    return 2;
  }
}
