// Lets a log line that a peer can cause at will (a connection flood, a descriptor limit
// reached) be written at most once per interval, saying how many were held back, so that
// a flood cannot fill the log or the disk under it.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace ckpt {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogLimiter(Clock::duration every) : every_(every) {}

  // When the line may be written now: how many were held back since the last one written
  // (HeldBack says it). nullopt: hold this one back.
  std::optional<uint64_t> Allow(Clock::time_point now = Clock::now()) {
    std::lock_guard lock(mu_);
    if (written_ && now - last_ < every_) {
      ++held_;
      return std::nullopt;
    }
    written_ = true;
    last_ = now;
    uint64_t held = held_;
    held_ = 0;
    return held;
  }

 private:
  const Clock::duration every_;
  std::mutex mu_;
  bool written_ = false;
  Clock::time_point last_;
  uint64_t held_ = 0;
};

// What to append to a line written after `held` others were held back: "" or " (N more
// since the last report)".
inline std::string HeldBack(uint64_t held) {
  return held == 0 ? std::string() : " (" + std::to_string(held) + " more since the last report)";
}

}  // namespace ckpt
