// How much of a shard's data region has landed in staging memory. The stager advances it
// chunk by chunk while the writer, already started, streams what has landed to storage:
// the device-to-host copy of chunk k+1 overlaps the write of chunk k.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"

namespace ckpt::daemon {

class StagingWatermark {
 public:
  // Bytes [0, landed) are in place. Never moves backwards.
  void Advance(uint64_t landed) {
    std::lock_guard lock(mu_);
    if (landed > landed_) landed_ = landed;
    cv_.notify_all();
  }

  // The copy failed: waiters get `why` instead of data.
  void Fail(std::string why) {
    std::lock_guard lock(mu_);
    error_ = std::move(why);
    failed_ = true;
    cv_.notify_all();
  }

  // Blocks until bytes [0, end) have landed, or the copy failed (then an error, whatever
  // has landed: a snapshot failed after its last byte, e.g. abandoned by its trainer, must
  // not be written as if complete).
  absl::Status WaitFor(uint64_t end) const {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return failed_ || landed_ >= end; });
    if (failed_) return absl::AbortedError("staging copy failed: " + error_);
    return absl::OkStatus();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t landed_ = 0;
  bool failed_ = false;
  std::string error_;
};

}  // namespace ckpt::daemon
