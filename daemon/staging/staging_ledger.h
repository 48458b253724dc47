// Fair shares of the node's staging memory. Every job with a live session is entitled to
// an equal share of --staging-bytes for snapshots in flight (staged, not yet committed or
// failed); a job may go beyond its share only while no other job is registered, and may
// always have one snapshot in flight, so that a job whose single snapshot is larger than
// its share still checkpoints. So one job that snapshots faster than its disk writes cannot
// take the memory another job's next checkpoint needs. Committed copies kept for hot
// restore are not counted: they are evicted whenever memory is short.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

class StagingLedger {
 public:
  // `active_jobs`: how many jobs have live sessions now.
  StagingLedger(size_t capacity, std::function<size_t()> active_jobs)
      : capacity_(capacity), active_jobs_(std::move(active_jobs)) {}

  // Bytes counted against a job while the hold lives.
  class Hold {
   public:
    Hold(StagingLedger& ledger, std::string job, size_t bytes)
        : ledger_(ledger), job_(std::move(job)), bytes_(bytes) {}
    ~Hold() { ledger_.Release(job_, bytes_); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    StagingLedger& ledger_;
    std::string job_;
    size_t bytes_;
  };
  using HoldPtr = std::unique_ptr<Hold>;

  // Counts `bytes` more for `job`, or ResourceExhausted naming the job's share.
  absl::StatusOr<HoldPtr> Admit(const std::string& job, size_t bytes);

  size_t in_flight(const std::string& job) const;

 private:
  void Release(const std::string& job, size_t bytes);

  const size_t capacity_;
  const std::function<size_t()> active_jobs_;
  mutable std::mutex mu_;
  std::map<std::string, size_t> in_flight_;
};

}  // namespace ckpt::daemon
