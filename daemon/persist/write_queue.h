// The I/O side of the persist stage: staged snapshots wait here and are written, one
// rank's shard per I/O thread, while the stager may still be copying them (the writer
// follows the snapshot's watermark). What happens to a written shard is the commit
// stage's business (WriteListener). Never blocks a caller on storage.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/persist/disk_quota.h"
#include "daemon/persist/increment_writer.h"
#include "daemon/persist/shard_writer.h"
#include "daemon/persist/write_listener.h"
#include "daemon/staging/progress_signal.h"
#include "daemon/staging/snapshot_sink.h"

namespace ckpt::persist {

class WriteQueue : public daemon::SnapshotSink {
 public:
  struct Options {
    int io_threads = 2;
    std::string tier = "local";  // what the store is, for metrics: local, or remote (--remote-mode direct)
    // Bounds the bytes each user and job may hold on the store (null: none); each shard is
    // admitted by it before it is written.
    DiskQuota* quota = nullptr;
    // --increments on: every shard is written in format version 5 by this writer (null:
    // the ShardWriter's full shards, versions 1-4).
    IncrementWriter* increments = nullptr;
  };
  // `on_written(bytes)` counts persisted bytes for status.
  WriteQueue(ShardWriter& writer, WriteListener& listener, daemon::ProgressSignal& progress,
             Options options, std::function<void(uint64_t)> on_written = {});
  ~WriteQueue() override;
  WriteQueue(const WriteQueue&) = delete;
  WriteQueue& operator=(const WriteQueue&) = delete;

  // After Shutdown the snapshot's ticket fails at once.
  void Submit(daemon::StagedSnapshotPtr snapshot) override;
  void Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) override {
    listener_.Refused(job, step, rank, why);
  }

  // Steps with a rank queued or being written, by job.
  std::map<std::string, std::vector<uint64_t>> Pending() const;

  // Stops taking work, lets queued writes finish for up to `timeout`, then fails the rest.
  void Shutdown(std::chrono::milliseconds timeout);

 private:
  void Loop();
  void Write(const daemon::StagedSnapshotPtr& snapshot);

  ShardWriter& writer_;
  WriteListener& listener_;
  daemon::ProgressSignal& progress_;
  const Options options_;
  std::function<void(uint64_t)> on_written_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<daemon::StagedSnapshotPtr> queue_;
  std::vector<daemon::StagedSnapshotPtr> writing_;
  bool stopping_ = false;
  bool aborting_ = false;
  std::vector<std::thread> threads_;
};

// Sets the ticket of each snapshot (through its session, if it is still there).
void NotifyTickets(const std::vector<daemon::StagedSnapshotPtr>& snapshots,
                   shm::TicketStateValue state, const std::string& error);

}  // namespace ckpt::persist
