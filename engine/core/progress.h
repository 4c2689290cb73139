#pragma once
// A progress bar on stderr, drawn only when stderr is a terminal (quiet in
// pipes and CI logs). Add() is thread-safe and cheap.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace ucp {

/// "512 B", "1.5 KiB", "3.2 GiB" (binary units, one decimal above bytes).
std::string HumanBytes(double bytes);

class Progress {
 public:
  enum class Mode { kAuto, kAlways, kNever };
  /// `total` is in `unit`s ("B" prints bytes as KiB/MiB/GiB).
  Progress(std::string label, uint64_t total, std::string unit = "B",
           Mode mode = Mode::kAuto);
  /// Without a Finish() (a failed run) only erases the bar, so that the
  /// error message that follows is not preceded by a completed-looking total.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Add(uint64_t amount) noexcept;
  /// Draws the final state and a newline (if drawing at all).
  void Finish() noexcept;
  bool enabled() const noexcept { return enabled_; }
  uint64_t done() const noexcept { return done_.load(); }

  /// Process-wide default used by Mode::kAuto (the CLI's --quiet/--progress).
  static void SetDefaultMode(Mode mode) noexcept;
  /// Whether a Progress of Mode::kAuto made now would draw a bar (the
  /// default mode and the terminal; an observer aside).
  static bool DefaultDraws() noexcept;

  /// Receives (label, done, total) instead of a bar being drawn: at most
  /// every 100 ms while running and once on Finish(), from any thread. It
  /// must not throw.
  using Observer = std::function<void(const std::string& label, uint64_t done,
                                      uint64_t total)>;
  /// While set (non-empty), every Progress created reports to `observer`
  /// whatever its mode, and draws nothing (the Python package's progress
  /// callback). Each Progress keeps the observer it was created with.
  static void SetObserver(Observer observer);

 private:
  void Draw(bool final) noexcept;
  std::string label_;
  std::string unit_;
  Observer observer_;
  uint64_t total_;
  bool enabled_;
  bool finished_ = false;
  std::atomic<uint64_t> done_{0};
  std::atomic<int64_t> next_draw_ns_{0};
  std::mutex draw_mutex_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace ucp
