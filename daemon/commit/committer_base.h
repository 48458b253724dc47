// What both committers share: the table of this node's undecided steps (which ranks
// arrived, which are durable, whose tickets wait), creating each step's .tmp directory
// once, refusing late ranks of an attempt that already ended, and ending a step (tickets,
// hooks, staging memory, the .tmp directory). Subclasses decide when a step commits.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "daemon/commit/committer.h"
#include "daemon/commit/manifest_builder.h"
#include "format/checkpoint_store.h"

namespace ckpt::daemon::commit {

class CommitterBase : public Committer {
 public:
  CommitterBase(format::CheckpointStore& store, CommitHooks hooks, CommitOptions options);

  absl::Status Arrived(const StagedSnapshotPtr& snapshot) override;
  absl::StatusOr<std::string> StepDirectory(const StagedSnapshotPtr& snapshot) override;
  void Failed(const StagedSnapshotPtr& snapshot, const std::string& error) override;
  void Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) override;
  std::vector<StepInFlight> InFlight() const override;

 protected:
  using Clock = std::chrono::steady_clock;
  using Key = std::pair<std::string, uint64_t>;

  struct Step {
    uint32_t world_size = 0;
    Clock::time_point started;
    std::shared_future<absl::Status> dir;  // the .tmp directory exists (valid once begun)
    std::set<uint32_t> arrived;
    DurableShards durable;
    std::vector<StagedSnapshotPtr> waiting;  // tickets to tell once decided
    std::string state = "writing";
    uint64_t attempt = 0;  // tells a step from an earlier attempt at the same number
    // The .tmp directory was refused to this attempt (it belongs to a step in doubt, or
    // the step is already committed): ending the attempt must leave it alone.
    bool foreign_dir = false;
    bool committed_dir = false;  // the step is committed on this node (foreign_dir too)
  };

  // Ends `key` as committed: the hot cache gets this node's snapshots, then the tickets
  // hear "committed". No-op when the step is not in the table.
  void FinishCommitted(const Key& key, const format::Manifest& manifest);
  // Ends `key` as failed: tickets hear `message`, staging memory is released, the .tmp
  // directory is removed (unless `keep_tmp`: its outcome is not known yet). Later ranks of
  // this attempt are refused with `message`.
  void FinishAborted(const Key& key, const std::string& message, bool keep_tmp = false);
  // Called when a rank of `key` failed to write, or was refused (the base has marked
  // nothing yet).
  virtual void OnLocalFailure(const Key& key, const std::string& message);
  // Called when a rank of `key` was refused before any of its ranks arrived on this node
  // (the base already refuses this attempt's later ranks). Group: the coordinator is told.
  virtual void OnRefusedBeforeArrival(const Key& key, const std::string& message) {}
  // Removes an unfinished step's files (group on a shared root: the coordinator does).
  virtual void DiscardUnfinished(const Key& key) { (void)store_.AbortStep(key.first, key.second); }
  // Extra refusals before a step's directory is created (group: a step in doubt).
  virtual absl::Status CheckStepAllowed(const Key& key) { return absl::OkStatus(); }
  // `world_size` minus the ranks in `have`: "1, 3" (at most 16 named).
  static std::string MissingRanks(uint32_t world_size, const std::set<uint32_t>& have);
  static std::set<uint32_t> Ranks(const DurableShards& shards);
  // The step `snapshot` belongs to, when it is still the attempt that snapshot arrived
  // in; nullptr for a late result of an attempt that already ended (its ticket was told),
  // which must never count towards, or fail, a newer attempt at the same step.
  Step* CurrentStepLocked(const StagedSnapshotPtr& snapshot);

  format::CheckpointStore& store_;
  const CommitHooks hooks_;
  const CommitOptions options_;

  mutable std::mutex mu_;
  std::map<Key, Step> steps_;
  // Attempt ids grow across restarts too (they start at the wall clock in ns), so the
  // coordinator can tell this node's newer attempt at a step from a late older one.
  uint64_t attempts_;  // guarded by mu_

 private:
  struct Ended {
    Clock::time_point when;
    std::string why;
  };
  void ForgetOldEndedLocked(Clock::time_point now);
  std::map<Key, Ended> ended_;  // aborted attempts, to refuse their late ranks
};

}  // namespace ckpt::daemon::commit
