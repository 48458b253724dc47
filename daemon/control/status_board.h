// Counters and recent errors that every stage reports into and `ckptctl status` reads.
// Counters are atomics; the error list is a small ring under a mutex (never held while
// calling out).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "daemon/session/session_events.h"

namespace ckpt::daemon {

class StatusBoard final : public SessionEvents {
 public:
  std::atomic<uint64_t> snapshots_staged{0};
  std::atomic<uint64_t> snapshots_rejected{0};
  std::atomic<uint64_t> checkpoints_committed{0};
  std::atomic<uint64_t> checkpoints_failed{0};
  std::atomic<uint64_t> bytes_persisted{0};

  void RecordError(std::string message);
  std::vector<std::string> RecentErrors() const;

  // Told of every snapshot staged (the replicator's start; set before sessions start).
  std::function<void(const StagedSnapshotPtr&, uid_t)> on_staged;

  // SessionEvents: counted, and rejections and errors kept among the recent errors.
  void SnapshotStaged(const StagedSnapshotPtr& snap, uid_t uid) override {
    snapshots_staged++;
    if (on_staged) on_staged(snap, uid);
  }
  void SnapshotRejected(std::string why) override {
    snapshots_rejected++;
    RecordError(std::move(why));
  }
  void SessionError(std::string message) override { RecordError(std::move(message)); }

 private:
  static constexpr size_t kMaxErrors = 32;
  mutable std::mutex mu_;
  std::deque<std::string> errors_;
};

}  // namespace ckpt::daemon
