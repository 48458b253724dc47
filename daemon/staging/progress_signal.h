// "Staging memory may have been freed": raised by whoever lets go of staging blocks (a
// write that finished, a decided step, an evicted hot copy) and awaited by the stager when
// the pool is full under --when-busy=wait. Stages signal it without knowing who waits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace ckpt::daemon {

class ProgressSignal {
 public:
  void Notify() {
    std::lock_guard lock(mu_);
    ++generation_;
    cv_.notify_all();
  }
  // Returns after the next Notify or `timeout`.
  void WaitFor(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    uint64_t seen = generation_;
    cv_.wait_for(lock, timeout, [&] { return generation_ != seen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
};

}  // namespace ckpt::daemon
