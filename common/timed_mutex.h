// A mutex whose lock may wait a bounded time (an update of a session waits for a snapshot
// briefly, then says busy). Built on std::mutex and a condition variable rather than
// std::timed_mutex: glibc's try_lock_for is pthread_mutex_clocklock, which GCC 12's
// ThreadSanitizer does not intercept, so every unlock after it read as an unlock of an
// unlocked mutex and the data it guards as unguarded.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace ckpt {

class TimedMutex {
 public:
  void lock() {
    std::unique_lock guard(mu_);
    free_.wait(guard, [&] { return !held_; });
    held_ = true;
  }
  bool try_lock() {
    std::lock_guard guard(mu_);
    if (held_) return false;
    held_ = true;
    return true;
  }
  template <typename Rep, typename Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& wait) {
    std::unique_lock guard(mu_);
    if (!free_.wait_for(guard, wait, [&] { return !held_; })) return false;
    held_ = true;
    return true;
  }
  void unlock() {
    {
      std::lock_guard guard(mu_);
      held_ = false;
    }
    free_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable free_;
  bool held_ = false;
};

}  // namespace ckpt
