// The persist stage: takes staged snapshots, writes each rank's shard on the I/O threads,
// commits a step once every rank of its world has been written, applies retention, keeps
// the newest committed snapshot of each rank in memory for hot restore, and tells each
// snapshot's session how it went. Never blocks a caller on storage.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "daemon/control/status_board.h"
#include "daemon/persist/checkpoint_store.h"
#include "daemon/persist/retention.h"
#include "daemon/persist/shard_writer.h"
#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

class Checkpointer {
 public:
  struct Options {
    persist::RetentionPolicy retention;
    int io_threads = 2;
  };

  Checkpointer(persist::CheckpointStore& store, persist::ShardWriter& writer, StatusBoard& board,
               Options options);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Queues a staged snapshot. After Shutdown the snapshot's ticket fails at once.
  void Submit(StagedSnapshotPtr snapshot);

  // The committed snapshot of (job, rank) at `step`, if it is still in memory.
  StagedSnapshotPtr FindHot(const std::string& job, uint32_t rank, uint64_t step) const;

  // Drops the oldest hot snapshot to free staging memory; false when there is none.
  bool EvictOneHot();

  // Sleeps until a write, commit or eviction may have freed staging memory, or `timeout`.
  void WaitForProgress(std::chrono::milliseconds timeout);

  // Overrides --keep-last for `job` (a trainer asked for it at registration); 0 restores
  // the daemon's setting.
  void SetKeepLast(const std::string& job, uint32_t keep_last);

  // Keeps `step` of `job` from being deleted by retention while it is read.
  class Pin {
   public:
    Pin(Checkpointer* owner, std::string job, uint64_t step);
    ~Pin();
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;

   private:
    Checkpointer* owner_;
    std::string job_;
    uint64_t step_;
  };

  struct JobView {
    std::vector<uint64_t> pending_steps;
    std::vector<uint64_t> hot_steps;
  };
  std::map<std::string, JobView> View() const;

  // Stops taking work, lets queued writes finish for up to `timeout`, then fails the rest
  // and removes unfinished step directories.
  void Shutdown(std::chrono::milliseconds timeout);

 private:
  struct PendingStep {
    uint32_t world_size = 0;
    std::shared_future<absl::Status> begun;  // the .tmp directory exists
    std::map<uint32_t, StagedSnapshotPtr> written;
    std::map<uint32_t, persist::WrittenShard> shards;
    std::set<uint32_t> arrived;  // submitted, written or not
    bool failed = false;
    std::string error;
    std::vector<StagedSnapshotPtr> waiting;  // tickets to notify when decided
  };
  using StepKey = std::pair<std::string, uint64_t>;

  void IoLoop();
  void Process(const StagedSnapshotPtr& snapshot);
  void Commit(const StepKey& key, PendingStep step);
  void FailStep(const StepKey& key, const std::string& error);
  // Logs, counts and records a failed step, removes its .tmp directory and fails the
  // tickets of `waiting`. Call without holding mu_.
  void ReportFailure(const StepKey& key, const std::string& message,
                     const std::vector<StagedSnapshotPtr>& waiting, spdlog::level::level_enum level);
  // True while some rank of `step` is queued or being written.
  bool InFlightLocked(const StepKey& key, const PendingStep& step) const;
  void ApplyRetention(const std::string& job);
  // Deletions run here, at idle CPU and I/O priority, so that freeing gigabytes of page
  // cache never competes with the next snapshot's copy.
  void JanitorLoop();
  static void Notify(const std::vector<StagedSnapshotPtr>& snapshots,
                     shm::TicketStateValue state, const std::string& error);

  persist::CheckpointStore& store_;
  persist::ShardWriter& writer_;
  StatusBoard& board_;
  const Options options_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable progress_cv_;
  std::deque<StagedSnapshotPtr> queue_;
  int busy_ = 0;
  bool stopping_ = false;
  bool aborting_ = false;
  std::map<StepKey, PendingStep> pending_;
  std::map<std::pair<std::string, uint32_t>, StagedSnapshotPtr> hot_;
  std::multiset<StepKey> pins_;
  std::map<std::string, uint32_t> keep_last_;  // per-job overrides of options_.retention
  std::deque<std::string> retention_jobs_;  // jobs whose retention is due
  std::condition_variable janitor_cv_;
  std::vector<std::thread> threads_;
  std::thread janitor_;
};

}  // namespace ckpt::daemon
