// Ranks of a job run on several nodes: each node prepares its durable ranks with the
// coordinator (two-phase commit, daemon/group/), and renames step-N.tmp only once the
// coordinator has recorded "committed"; the tickets hear the global decision, never a
// local one. A step whose outcome this node cannot learn (the coordinator is unreachable)
// stays "in doubt": its .tmp is kept and asked about until answered, its staging memory
// released after the step timeout. Steps found in .tmp at start-up are in doubt too.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

#include "daemon/commit/committer_base.h"
#include "daemon/group/group_client.h"

namespace ckpt::daemon::commit {

class GroupCommitter : public CommitterBase {
 public:
  GroupCommitter(format::CheckpointStore& store, CommitHooks hooks, CommitOptions options,
                 group::GroupClient& client, uint32_t node_rank);
  ~GroupCommitter() override;

  void Durable(const StagedSnapshotPtr& snapshot, persist::WrittenShard shard) override;
  std::vector<StepInFlight> InFlight() const override;
  void Shutdown() override;
  // As the base does, on a thread of its own: it may tell the coordinator.
  void Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) override;

  // Steps this node holds in step-N.tmp from an earlier run: their outcome is asked of the
  // coordinator, then they are renamed or removed.
  void AdoptInDoubt(const std::vector<std::pair<std::string, uint64_t>>& steps);

 protected:
  void OnLocalFailure(const Key& key, const std::string& message) override;
  void OnRefusedBeforeArrival(const Key& key, const std::string& message) override;
  absl::Status CheckStepAllowed(const Key& key) override;
  void DiscardUnfinished(const Key& key) override;

 private:
  struct Watch {
    std::set<uint32_t> unsent;   // durable ranks whose prepare was not acknowledged
    bool acknowledged = false;   // the coordinator has seen a prepare of this node
    Clock::time_point since;     // first prepare (or adoption)
    bool released = false;       // tickets told "in doubt", memory released
    bool adopted = false;        // found on disk at start-up: no snapshots here
    uint64_t attempt = 0;        // the Step::attempt it watches; 0 when adopted
  };

  // Sends prepares for `ranks` of `key`; true when acknowledged. Applies a decision that
  // comes back with the reply.
  bool SendPrepare(const Key& key, uint64_t attempt, const std::set<uint32_t>& ranks);
  // The ranks of `key` to prepare now, taken from unsent (a sender that fails puts them
  // back): every unsent durable rank, once none of this node's arrived ranks is still being
  // written; empty before then.
  std::set<uint32_t> TakeReadyLocked(const Key& key, uint64_t attempt);
  // A prepare of `ranks` returned: acknowledged, or back to unsent to be sent again.
  void SentLocked(const Key& key, uint64_t attempt, const std::set<uint32_t>& ranks, bool delivered);
  void EnsureWatcherLocked(const Key& key);
  void WatchLoop(Key key);
  // Renames (committed) or removes (aborted, unknown) the step on disk and ends it.
  // Only for `attempt`: a decision about an earlier attempt never ends a newer one.
  void Apply(const Key& key, uint64_t attempt, const group::Decision& decision);
  void ReleaseInDoubt(const Key& key, double waited_s);
  // What this node publishes of a committed step: the whole manifest (node 0, a shared
  // root) or this node's ranks with the step's header (docs/format.md, "Across nodes").
  // A commit that does not give this node exactly the ranks and bytes it wrote is refused
  // rather than renamed into place.
  absl::StatusOr<format::Manifest> Publishable(const Key& key, const group::CommittedStep& committed);
  // A whole manifest must be about `key`, of this node's attempt, and list this node's
  // durable ranks as the files it wrote.
  absl::Status CheckWhole(const Key& key, const group::CommittedStep& committed, const format::Manifest& manifest);
  // Whether this node holds the step's snapshots, of `attempt` (0: of any attempt).
  bool HoldsAttempt(const Key& key, uint64_t attempt);
  // This node's manifest of a committed step whose snapshots it no longer holds, from the
  // record of what it prepared (CheckpointStore::RecordPrepared) and the commit's header.
  absl::StatusOr<format::Manifest> FromPreparedRecord(const Key& key, const group::CommittedStep& committed);
  // A commit is bound to the bytes it was made of: NotFound, naming both, when the run
  // (and, where both sides know it, the attempt) the commit records for this node is not
  // that of `run` / `attempt` from `source` (a new run saved the step number again; an
  // attempt after a delete). Such a decision is about other bytes and is never applied to
  // these.
  absl::Status CheckBoundTo(const Key& key, const group::CommittedStep& committed, uint64_t run, uint64_t attempt,
                            const std::string& source) const;
  // A step kept in doubt, published from a whole manifest: this node's ranks in it must be
  // the very bytes it recorded preparing (run, files, sizes, every checksum); NotFound
  // naming the first difference otherwise.
  absl::Status CheckRecordedBytes(const Key& key, const group::CommittedStep& committed,
                                  const format::Manifest& whole);
  // `part` (the ranks this node holds, known from `source`, of `attempt`; 0: not known)
  // scoped to the commit: refused unless the commit gives this node exactly these ranks and
  // bytes, of that attempt and run (CheckBoundTo).
  absl::StatusOr<format::Manifest> ScopedToCommit(const group::CommittedStep& committed, format::Manifest part,
                                                  uint64_t attempt, const std::string& source);

  group::GroupClient& client_;
  const uint32_t node_rank_;
  std::map<Key, Watch> watches_;  // guarded by mu_
  std::condition_variable watch_cv_;
  bool stopping_ = false;  // guarded by mu_
  // Steps whose refusal is being acted on, each on a thread of its own (Refused).
  static constexpr size_t kMaxRefusing = 16;
  std::set<Key> refusing_;  // guarded by mu_
  std::set<Key> applying_;  // decisions being applied; guarded by mu_
  std::set<Key> watched_;  // steps with a watcher thread; guarded by mu_
  int watchers_ = 0;        // running watcher threads; guarded by mu_
};

}  // namespace ckpt::daemon::commit
