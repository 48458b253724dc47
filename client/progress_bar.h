// Progress of a long ckptctl command (export, verify) on stderr: a bar redrawn in place on a
// terminal, or, for logs, a plain line every few seconds; and how sizes are written.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace ckpt::ctl {

// A size as people read it: "512 B", "96.0 KiB", "1.5 GiB" (what ckptctl prints everywhere).
std::string HumanBytes(uint64_t bytes);

class ProgressBar {
 public:
  enum class Style { kBar, kLines };
  // `what` begins each line ("verify", "export").
  ProgressBar(std::string what, Style style) : what_(std::move(what)), style_(style) {}

  // `done` of `total` bytes; the last call (done == total) ends the bar's line.
  void Update(uint64_t done, uint64_t total);

 private:
  const std::string what_;
  const Style style_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
  bool finished_ = false;
};

}  // namespace ckpt::ctl
