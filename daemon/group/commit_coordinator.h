// The coordinator's half of the two-phase commit (node 0 runs it). Nodes report the ranks
// whose shards are durable in their step-N.tmp ("prepared"); once every rank of the
// world is prepared the coordinator merges the parts into the step's manifest, records
// the decision durably, and only then announces "committed". A step that cannot complete
// (timeout, a node lost or restarted, an error reported by a node, parts that disagree)
// is aborted. Pure logic over an injected DecisionLog and clock: the gRPC service and the
// tests drive it the same way.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "daemon/group/committed_step.h"
#include "daemon/group/decision_log.h"
#include "format/manifest.h"

namespace ckpt::group {

enum class Outcome { kUnknown, kPending, kCommitted, kAborted };

// The thread that assembles node 0's whole manifests (as `top -H` and /proc show it).
inline constexpr char kAssemblerThreadName[] = "ckptd-assemble";

struct Decision {
  Outcome outcome = Outcome::kUnknown;
  std::string reason;  // why aborted
  // Committed: the step as recorded, shared by every answer about it (at 10,000 nodes its
  // manifest is tens of MB: never copied per answer).
  std::shared_ptr<const CommittedStep> committed;
};

struct StepProgress {
  std::string job;
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::vector<uint32_t> missing_ranks;
  double age_s = 0;
};

class CommitCoordinator {
 public:
  using Clock = std::chrono::steady_clock;
  using Waiter = std::function<void(const Decision&)>;

  // With one shared filesystem (--shared-root) the coordinator itself publishes a step
  // (writes the one manifest, renames the directory) after recording the decision and
  // before announcing it, and removes an aborted step's directory. Empty: every node
  // publishes its own part (node-local disks).
  struct Publisher {
    std::function<absl::Status(const format::Manifest&)> commit;
    // Writes a node's part of an indexed step into its staging and adds it to the index
    // (CheckpointStore::WriteManifestPart): a step whose whole manifest is too large.
    std::function<absl::Status(const format::Manifest& part, format::Manifest& index)> write_part;
    std::function<void(const std::string& job, uint64_t step)> discard;
    // An incremental step (format version 5) references earlier steps' files, which the
    // coordinator's retention manages on the shared root: before the decision is recorded,
    // pins the steps `manifest` (whole, or the index) references and checks that each is
    // still there, committed or held; the pin lives until the step is published. An error
    // aborts the step (a node's base went while it wrote: its next save is full).
    std::function<absl::StatusOr<std::shared_ptr<void>>(const format::Manifest& manifest)> hold_origins;
  };

  struct Options {
    std::chrono::milliseconds step_timeout{300'000};
    uint32_t max_world_size = 1u << 20;
    Publisher publish;
    // Committed manifests kept in memory with their decisions, in all; older ones are read
    // back from the decision log when node 0 (or a node in doubt) asks for one (the newest
    // is always kept). At 10,000 nodes one manifest is tens of MB. Headers and node shares,
    // what the other nodes ask for, stay.
    size_t recent_manifest_bytes = size_t{64} << 20;
    // A whole manifest larger than this is kept in the decision log only: node 0 publishes
    // its own ranks (CheckpointStore::kMaxManifestBytes, what a reader loads).
    size_t max_whole_manifest_bytes = size_t{64} << 20;
    // Committed steps waiting for their whole manifest to be assembled, in manifest bytes
    // (about): beyond it the oldest are given up (node 0 publishes its own ranks of them).
    // The newest is always kept.
    size_t assembly_queue_bytes = size_t{256} << 20;
    // Drops the structure under a digest from the structure cache: a new combination found
    // it held as a summary only, and its node must send it whole again.
    std::function<void(const std::string& digest)> forget_structure;
  };

  CommitCoordinator(DecisionLog& log, Options options);
  // Stops the assembler (ReleaseWaiters first: waiters it holds hear "pending").
  ~CommitCoordinator();

  // `node` has made `ranks` of (job, step) durable in its attempt `attempt` at the step;
  // `part` is their manifest. Attempt ids of a node grow: a prepare of a newer attempt
  // replaces everything the node said in older ones (their files are gone or rewritten),
  // and a late prepare of an older attempt is refused, so a commit never mixes attempts.
  // Returns the step's state after this: pending, committed (this completed it, or a
  // retry of a prepare that was part of the commit), or aborted with the reason. The
  // values must fit the structure (format::CheckValuesFit); a commit carries the header
  // and shares, and the whole manifest only once asked for (Lookup).
  Decision Prepare(uint32_t node, uint64_t attempt, PreparedPart part);
  // The same for a whole part (tests, and parts not yet split).
  Decision Prepare(uint32_t node, uint64_t attempt, const format::Manifest& part);

  // `node` cannot finish its attempt `attempt` at the step (a rank failed to write). An
  // abort from an attempt older than the one the node prepared in this round is late and
  // ignored. Before any prepare, an abort of a step already committed (or at or below the
  // job's newest commit) is late and ignored too, unless `run` (the aborting attempt's run,
  // 0: not known) is newer than that commit: a new run saving the step number again, which
  // this node refused (it still holds the earlier run's step).
  void Abort(const std::string& job, uint64_t step, uint32_t node, uint64_t attempt,
             const std::string& reason, uint64_t run = 0);

  // Calls `waiter` once the step is decided, or with what is known at `deadline`
  // (pending while undecided; unknown when there is no record). A waiter for the whole
  // manifest of a step being committed hears once it is assembled, after everyone else.
  void Await(const std::string& job, uint64_t step, Clock::time_point deadline, Waiter waiter,
             bool whole_manifest = false);

  // What is known now, without waiting. A committed decision carries the whole manifest
  // when `whole_manifest` (node 0, which publishes it), else perhaps only the header and
  // node shares every other node needs. The whole manifest is assembled from the parts on
  // the first such call, off the commit path, and recorded beside the decision.
  Decision Lookup(const std::string& job, uint64_t step, bool whole_manifest = false);

  // Aborts undecided steps that are missing ranks, naming `why` (a node was lost or
  // restarted: its trainers' ranks can no longer arrive).
  void AbortIncomplete(const std::string& why);

  // `node` was marked lost (`why`), silent since `silent_since_unix_ns`: undecided steps
  // are aborted, and until it joins again (MemberBack) a step of a job whose last commit had
  // ranks on it, with that commit's world size, is aborted as soon as its first prepare
  // arrives when the run preparing it began before the node fell silent: that run's ranks
  // on the lost node cannot be prepared (the node is refused until it joins again), so the
  // step could only wait for its timeout while holding every node's staging. `version` is
  // the membership's version of the change: a loss and a join that race reach here in
  // either order, and the newer one wins.
  void MemberLost(uint32_t node, const std::string& why, uint64_t version, uint64_t silent_since_unix_ns);
  void MemberBack(uint32_t node, uint64_t version);

  // Step timeouts and waiter deadlines; call a few times a second.
  void Tick(Clock::time_point now);

  std::vector<StepProgress> InFlight() const;
  std::map<std::string, uint64_t> LatestCommitted() const;

  // Fails every waiter (shutdown): they hear "pending" and ask again elsewhere.
  void ReleaseWaiters();

 private:
  struct PendingWaiter {
    Clock::time_point deadline;
    Waiter waiter;
    bool whole = false;  // wants the whole manifest
  };
  static constexpr uint32_t kNoNode = ~uint32_t{0};
  // What a node said in a round: the attempt it prepared in, and how many of the round's
  // parts are its (0 for most, so that a first prepare only appends).
  struct NodeWord {
    uint64_t attempt = 0;
    uint32_t parts = 0;
  };
  using NodeWords = std::unordered_map<uint32_t, NodeWord>;
  struct Round {
    uint32_t world_size = 0;
    Clock::time_point started;
    // The node that prepared each rank, kNoNode while none has: a vector, so that the
    // missing ranks every heartbeat reply lists are found without a walk of a tree.
    std::vector<uint32_t> node_of_rank;
    uint32_t prepared = 0;  // ranks with a node
    // Every node that spoke, by node: hashed, as node 0 meets 10,000 of them a step.
    NodeWords nodes;
    // What the nodes prepared, in arrival order (one part per prepare; nodes send one a
    // step); a part a node's newer word replaced has no structure. Sorted by node once,
    // when the round is complete.
    PreparedParts parts;
    std::vector<PendingWaiter> waiters;
    bool deciding = false;  // every rank prepared: being merged and recorded, unlocked
  };
  struct Remembered {
    Decision decision;
    std::map<uint32_t, uint64_t> attempts;  // of an aborted round, by node
    // When it was aborted (wall clock, ns): a late prepare from a run that began before
    // then (Manifest::run, the registration of its newest rank) belongs to the aborted
    // attempt and hears the abort again, rather than opening a round that can only time
    // out. Runs compare across nodes' clocks: a skew makes the rule fall back to waiting
    // (a node ahead) or refuse a run restarted within the skew (a node behind).
    uint64_t aborted_unix_ns = 0;
  };
  struct MemberNews {
    uint64_t version = 0;      // of the membership change last applied
    bool lost = false;
    std::string why;
    uint64_t since_unix_ns = 0;  // silent since
  };
  using Key = std::pair<std::string, uint64_t>;
  using Notifications = std::vector<std::pair<Waiter, Decision>>;

  // A complete round's parts, by node, and the attempt each node prepared them in.
  struct CompleteRound {
    PreparedParts parts;
    NodeWords nodes;
  };
  // What the structures of a complete round say once merged and checked for tiling (a
  // step's structures rarely change, so this is computed once per combination).
  struct StructureCheck {
    absl::Status status;
    uint32_t tensors = 0;
  };
  // The parts of a complete round, which is marked deciding, sorted by node.
  static CompleteRound TakePartsLocked(Round& round);
  // Checks and records a complete round's parts without holding mu_, then ends the round
  // committed (or aborted when the parts disagree or the record fails).
  Decision Decide(const Key& key, CompleteRound complete, Notifications& out);
  // The merge-and-tiling check of these parts' structures, from checks_ when it was made.
  StructureCheck CheckStructures(const PreparedParts& parts);
  // The committed step with its whole manifest, assembled from its parts (and recorded
  // beside its decision) or read back from the log.
  Decision WithWholeManifest(const Key& key, const Decision& decision);
  // The same committed step, marked as having no whole manifest (node 0 publishes its own
  // ranks): its assembly was given up.
  static Decision WithoutWholeManifest(const Decision& decision);
  // Why the whole manifest of these parts will not be assembled (far too large, some
  // structures held as summaries only, or some nodes' checksums withheld); nullopt when it
  // will.
  struct NotAssembled {
    std::string why;
    bool checksums_unused;  // the reason lasts beyond this step: nodes may withhold checksums
  };
  std::optional<NotAssembled> WhyNotAssembled(const PreparedParts& parts) const;
  // On a shared root, a step too large for one manifest: each node's part, scoped to the
  // commit `header` (its digest set), written with publish.write_part; returns their index.
  absl::StatusOr<format::Manifest> WriteIndexedParts(const PreparedParts& parts, const StepHeader& header);
  // The assembler thread: builds and records each committed step's whole manifest after
  // its decision was announced, then answers the waiters that asked for it.
  void AssembleLoop();
  // With mu_ held; the waiters to notify go to `out`, called after unlocking.
  void AbortLocked(const Key& key, const std::string& reason, Notifications& out);
  void RememberLocked(const Key& key, Decision decision, std::map<uint32_t, uint64_t> attempts = {});
  // Drops a remembered decision (a new attempt at its step replaces it).
  void ForgetLocked(std::map<Key, Remembered>::iterator it);
  // How a prepare by `node` of `ranks` in `attempt` of run `run` relates to the commit of
  // its step: the very attempt the commit was made of (a retry), a newer attempt or run
  // (a new round), or an older one (refused).
  enum class CommitMatch { kRetry, kNewer, kOlder };
  static CommitMatch CompareToCommit(const CommittedStep& c, uint32_t node, uint64_t attempt, uint64_t run,
                                     const std::vector<uint32_t>& ranks);
  // The committed step `key` as remembered now (with or without its whole manifest), if it
  // is still remembered.
  void ReplaceRememberedLocked(const Key& key, const Decision& decision);
  static void ReplaceRanksLocked(Round& round, uint32_t node, PreparedPart part);
  // Removes the parts a newer word replaced (those without a structure) from the round.
  static void DropReplacedParts(Round& round);
  static void ForgetNodeLocked(Round& round, uint32_t node);
  // Records that `node` prepared `rank`; the node that had already prepared it otherwise.
  static std::optional<uint32_t> ClaimLocked(Round& round, uint32_t rank, uint32_t node);
  // The first `most` ranks no node has prepared yet.
  static std::vector<uint32_t> MissingRankList(const Round& round, size_t most);
  // The same as text: "1, 2, ..." (`limit` named).
  static std::string MissingRanks(const Round& round, size_t limit = 16);
  // Why a run of `job` that began at `run` (ns) cannot commit now: a node that held ranks
  // of the job's last commit is lost since after `run`. nullopt when none is.
  std::optional<std::string> LostHolderLocked(const std::string& job, uint64_t run, uint32_t world_size) const;
  static void Deliver(Notifications& notifications);
  // The decision of a committed step, from the decision log (a restarted coordinator, or
  // a manifest dropped from memory), with its whole manifest when `whole` and recorded;
  // unknown when there is no record.
  Decision FromLog(const Key& key, bool whole);

  DecisionLog& log_;
  const Options options_;
  mutable std::mutex mu_;
  std::map<Key, Round> rounds_;
  uint64_t round_ranks_ = 0;  // the world sizes of rounds_, in all: what they hold in memory
  // Recent decisions, for quick answers and to tell a retried prepare from a new attempt.
  std::map<Key, Remembered> recent_;
  std::deque<Key> recent_order_;
  size_t recent_manifest_bytes_ = 0;  // of the decisions in recent_
  size_t recent_share_bytes_ = 0;
  // Per job: its newest committed step, and the world and nodes of its last commit.
  struct JobCommits {
    uint64_t latest_step = 0;
    uint64_t latest_run = 0;  // the newest run of its commits
    uint32_t world_size = 0;
    std::vector<uint32_t> nodes;
  };
  std::map<std::string, JobCommits> jobs_;
  std::map<uint32_t, MemberNews> members_;
  // Structure checks made, by the combination of (node, structure digest) they were made
  // for; a few per job (a job that changes its structure makes a new one).
  std::mutex checks_mu_;
  std::list<std::string> checks_order_;  // least recently used first
  std::map<std::string, std::pair<StructureCheck, std::list<std::string>::iterator>> checks_;
  // Committed steps whose whole manifest is still to be assembled, with the waiters for it;
  // guarded by mu_.
  std::deque<std::pair<Key, Decision>> to_assemble_;
  size_t queued_assembly_bytes_ = 0;  // their WholeManifestEstimate, in all
  std::map<Key, std::vector<PendingWaiter>> awaiting_whole_;
  std::condition_variable assemble_cv_;
  bool stopping_ = false;
  std::thread assembler_;  // last: started once everything above exists
};

const char* OutcomeName(Outcome outcome);

}  // namespace ckpt::group
