// Gives copies the trainer is waiting for (staging, restore) the machine's memory
// bandwidth first: background work (persisting shards) waits between its chunks while a
// copy runs. Bounded: background work is delayed, never starved.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace ckpt::cuda {

class CopyPriority {
 public:
  // RAII: marks a latency-critical copy in progress.
  class Copying {
   public:
    explicit Copying(CopyPriority* gate) : gate_(gate) {
      if (gate_) gate_->Begin();
    }
    ~Copying() {
      if (gate_) gate_->End();
    }
    Copying(const Copying&) = delete;
    Copying& operator=(const Copying&) = delete;

   private:
    CopyPriority* gate_;
  };

  // Called by background work between chunks: returns once no copy runs, or after `max`.
  void YieldToCopies(std::chrono::milliseconds max) {
    std::unique_lock lock(mu_);
    idle_.wait_for(lock, max, [this] { return active_ == 0; });
  }

 private:
  void Begin() {
    std::lock_guard lock(mu_);
    ++active_;
  }
  void End() {
    std::lock_guard lock(mu_);
    if (--active_ == 0) idle_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable idle_;
  int active_ = 0;
};

}  // namespace ckpt::cuda
