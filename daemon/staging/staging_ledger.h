// Fair shares of the node's staging memory, per user first and then per job. Every user
// (uid) with a live session is entitled to an equal share of --staging-bytes for snapshots
// in flight (staged, not yet committed or failed), and each of that user's jobs to an
// equal part of the user's share. A user or job may go beyond its share only while no
// other user or job is registered, and may always have one snapshot in flight, so that a
// job whose single snapshot is larger than its share still checkpoints. So neither one job
// that snapshots faster than its disk writes, nor one user who starts many jobs, can take
// the memory another user's next checkpoint needs. Committed copies kept for hot restore
// are not counted: they are evicted whenever memory is short.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

class StagingLedger {
 public:
  // Who has live sessions now: each uid with the jobs it has sessions in.
  using ActiveUsers = std::map<uid_t, std::set<std::string>>;

  // `memory` and `flag` name what is shared in messages: the staging memory and
  // --staging-bytes, or another budget kept the same way (peers' replicas, --replica-bytes).
  StagingLedger(size_t capacity, std::function<ActiveUsers()> active, std::string memory = "the staging memory",
                std::string flag = "--staging-bytes")
      : capacity_(capacity), active_(std::move(active)), memory_(std::move(memory)), flag_(std::move(flag)) {}

  // Bytes counted against a job and its user while the hold lives.
  class Hold {
   public:
    Hold(StagingLedger& ledger, uid_t uid, std::string job, size_t bytes)
        : ledger_(ledger), uid_(uid), job_(std::move(job)), bytes_(bytes) {}
    ~Hold() { ledger_.Release(uid_, job_, bytes_); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    // `bytes` of this hold (at most all of them) as a hold of their own, released on its own:
    // memory admitted with a snapshot that outlives it (a frozen block).
    std::unique_ptr<Hold> Split(size_t bytes) {
      bytes = bytes < bytes_ ? bytes : bytes_;
      bytes_ -= bytes;
      return std::make_unique<Hold>(ledger_, uid_, job_, bytes);
    }

   private:
    StagingLedger& ledger_;
    uid_t uid_;
    std::string job_;
    size_t bytes_;
  };
  using HoldPtr = std::unique_ptr<Hold>;

  // Counts `bytes` more for `job` of `uid`, or ResourceExhausted naming the share.
  absl::StatusOr<HoldPtr> Admit(uid_t uid, const std::string& job, size_t bytes);

  size_t in_flight(const std::string& job) const;
  size_t in_flight_of_user(uid_t uid) const;
  // Every job's and user's bytes in flight now (metrics).
  std::map<std::string, size_t> InFlightByJob() const;
  std::map<uid_t, size_t> InFlightByUser() const;

 private:
  void Release(uid_t uid, const std::string& job, size_t bytes);

  const size_t capacity_;
  const std::function<ActiveUsers()> active_;
  const std::string memory_;
  const std::string flag_;
  mutable std::mutex mu_;
  std::map<std::string, size_t> of_job_;
  std::map<uid_t, size_t> of_user_;
};

}  // namespace ckpt::daemon
