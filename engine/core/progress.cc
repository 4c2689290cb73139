#include "engine/core/progress.h"

#include <unistd.h>

#include <cstdio>

namespace ucp {
namespace {

std::atomic<Progress::Mode> g_default_mode{Progress::Mode::kAuto};

std::string Human(double value, const std::string& unit) {
  if (unit == "B") return HumanBytes(value);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f %s", value, unit.c_str());
  return buf;
}

}  // namespace

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024 && u < 5) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes,
                units[u]);
  return buf;
}

void Progress::SetDefaultMode(Mode mode) noexcept { g_default_mode = mode; }

bool Progress::DefaultDraws() noexcept {
  const Mode mode = g_default_mode.load();
  return mode == Mode::kAlways ||
         (mode == Mode::kAuto && ::isatty(STDERR_FILENO) == 1);
}

namespace {
std::mutex g_observer_mutex;
Progress::Observer& GlobalObserver() {
  static Progress::Observer* observer = new Progress::Observer();  // leaked
  return *observer;
}
}  // namespace

void Progress::SetObserver(Observer observer) {
  std::lock_guard<std::mutex> lock(g_observer_mutex);
  GlobalObserver() = std::move(observer);
}

Progress::Progress(std::string label, uint64_t total, std::string unit,
                   Mode mode)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      start_(std::chrono::steady_clock::now()) {
  {
    std::lock_guard<std::mutex> lock(g_observer_mutex);
    observer_ = GlobalObserver();
  }
  if (mode == Mode::kAuto) mode = g_default_mode.load();
  enabled_ = observer_ || mode == Mode::kAlways ||
             (mode == Mode::kAuto && ::isatty(STDERR_FILENO) == 1);
}

Progress::~Progress() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(draw_mutex_);
  if (finished_) return;
  finished_ = true;
  if (observer_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

void Progress::Add(uint64_t amount) noexcept {
  done_.fetch_add(amount, std::memory_order_relaxed);
  if (!enabled_) return;
  int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - start_)
                    .count();
  int64_t next = next_draw_ns_.load(std::memory_order_relaxed);
  if (now < next) return;
  if (!next_draw_ns_.compare_exchange_strong(next, now + 100'000'000)) return;
  Draw(false);
}

void Progress::Finish() noexcept {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(draw_mutex_);
  if (finished_) return;
  finished_ = true;
  if (observer_) {
    observer_(label_, done_.load(), total_);
    return;
  }
  double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_)
          .count();
  double done = static_cast<double>(done_.load());
  std::fprintf(stderr, "\r\033[K%s: %s in %.1f s", label_.c_str(),
               Human(done, unit_).c_str(), secs);
  if (unit_ == "B" && secs > 0) {
    std::fprintf(stderr, " (%s/s)", Human(done / secs, unit_).c_str());
  }
  std::fprintf(stderr, "\n");
}

void Progress::Draw(bool /*final*/) noexcept {
  std::lock_guard<std::mutex> lock(draw_mutex_);
  if (finished_) return;
  if (observer_) {
    observer_(label_, done_.load(), total_);
    return;
  }
  double done = static_cast<double>(done_.load());
  double total = static_cast<double>(total_);
  double frac = total > 0 ? done / total : 0;
  if (frac > 1) frac = 1;
  constexpr int kWidth = 30;
  char bar[kWidth + 1];
  int filled = static_cast<int>(frac * kWidth);
  for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '#' : '.';
  bar[kWidth] = '\0';
  std::fprintf(stderr, "\r\033[K%s [%s] %3.0f%% %s / %s", label_.c_str(), bar,
               frac * 100, Human(done, unit_).c_str(),
               Human(total, unit_).c_str());
  std::fflush(stderr);
}

}  // namespace ucp
