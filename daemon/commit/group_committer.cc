#include "daemon/commit/group_committer.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "daemon/group/committed_step.h"
#include "daemon/metrics/daemon_metrics.h"
#include "common/log.h"
#include "common/status.h"

namespace ckpt::daemon::commit {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

// One outcome long poll; the loop re-checks shutdown and unsent prepares between polls.
constexpr std::chrono::milliseconds kOutcomePoll{2000};
// Back-off while the coordinator is unreachable.
constexpr std::chrono::milliseconds kRetryPause{250};

}  // namespace

GroupCommitter::GroupCommitter(format::CheckpointStore& store, CommitHooks hooks,
                               CommitOptions options, group::GroupClient& client,
                               uint32_t node_rank)
    : CommitterBase(store, std::move(hooks), options), client_(client), node_rank_(node_rank) {}

GroupCommitter::~GroupCommitter() { Shutdown(); }

void GroupCommitter::Durable(const StagedSnapshotPtr& snapshot, persist::WrittenShard shard) {
  const Key key{snapshot->job, snapshot->step};
  uint64_t attempt = 0;
  std::set<uint32_t> ready;
  {
    std::lock_guard lock(mu_);
    Step* step = CurrentStepLocked(snapshot);
    if (step == nullptr) return;  // its attempt already ended and its ticket was told
    attempt = step->attempt;
    step->durable[snapshot->rank] = {snapshot, std::move(shard)};
    step->state = "prepared";
    Watch& w = watches_[key];
    if (w.attempt != attempt) {
      w = Watch{};
      w.attempt = attempt;
    }
    if (w.since == Clock::time_point{}) w.since = Clock::now();
    w.unsent.insert(snapshot->rank);
    ready = TakeReadyLocked(key, attempt);
  }
  // Prepared from the I/O thread at once, one prepare for all of this node's ranks: the
  // commit follows the last rank's fsync without waiting for a poll, and the coordinator
  // hears from each node once a step, not once per rank.
  if (!ready.empty()) SendPrepare(key, attempt, ready);
  std::lock_guard lock(mu_);
  if (auto w = watches_.find(key); w != watches_.end() && w->second.attempt == attempt) {
    EnsureWatcherLocked(key);
  }
}

std::set<uint32_t> GroupCommitter::TakeReadyLocked(const Key& key, uint64_t attempt) {
  auto w = watches_.find(key);
  if (w == watches_.end() || w->second.attempt != attempt || w->second.unsent.empty()) return {};
  auto step = steps_.find(key);
  if (step != steps_.end() && step->second.attempt == attempt) {
    // A rank of this node still being written will be durable soon (or fail the step):
    // its prepare carries the others too.
    for (uint32_t rank : step->second.arrived) {
      if (!step->second.durable.count(rank)) return {};
    }
  }
  // Taken by one sender (the I/O thread or the watcher), never both.
  std::set<uint32_t> ready = std::move(w->second.unsent);
  w->second.unsent.clear();
  return ready;
}

void GroupCommitter::SentLocked(const Key& key, uint64_t attempt, const std::set<uint32_t>& ranks,
                                bool delivered) {
  auto w = watches_.find(key);
  if (w == watches_.end() || w->second.attempt != attempt) return;
  if (delivered) {
    w->second.acknowledged = true;
  } else {
    w->second.unsent.insert(ranks.begin(), ranks.end());
  }
}

bool GroupCommitter::SendPrepare(const Key& key, uint64_t attempt,
                                 const std::set<uint32_t>& ranks) {
  absl::StatusOr<format::Manifest> part;
  std::optional<format::Manifest> record;  // node-local disks: kept in the step's staging
  {
    std::lock_guard lock(mu_);
    auto it = steps_.find(key);
    if (it == steps_.end() || it->second.attempt != attempt) {
      // The attempt ended here (released in doubt, or superseded): its snapshots are gone,
      // so there is nothing left to send; the watcher only asks for the outcome now.
      if (auto w = watches_.find(key); w != watches_.end() && w->second.attempt == attempt) {
        w->second.unsent.clear();
      }
      return true;
    }
    DurableShards chosen;
    for (uint32_t r : ranks) {
      if (auto d = it->second.durable.find(r); d != it->second.durable.end()) chosen.insert(*d);
    }
    if (chosen.empty()) {
      SentLocked(key, attempt, ranks, /*delivered=*/false);
      return false;
    }
    part = BuildManifest(key.first, key.second, it->second.world_size, chosen);
    if (part.ok() && !store_.shared()) {
      // What this node publishes from if it restarts before hearing the decision: every
      // rank of the attempt prepared so far, this prepare's and earlier ones'.
      if (chosen.size() == it->second.durable.size()) {
        record = *part;
      } else if (auto all = BuildManifest(key.first, key.second, it->second.world_size, it->second.durable); all.ok()) {
        record = std::move(*all);
      } else {
        part = all.status();
      }
    }
  }
  if (part.ok() && record) {
    if (absl::Status kept = store_.RecordPrepared(*record); !kept.ok()) {
      part = Annotate(kept, "recording the prepared ranks");
    }
  }
  if (!part.ok()) {
    {
      std::lock_guard lock(mu_);
      SentLocked(key, attempt, ranks, /*delivered=*/false);
    }
    OnLocalFailure(key, Message(part.status()));
    return false;
  }
  auto reply = client_.Prepare(*part, attempt);
  {
    std::lock_guard lock(mu_);
    SentLocked(key, attempt, ranks, reply.ok());
  }
  if (!reply.ok()) {
    Log().warn("[{} s{}] prepare of ranks {} not delivered (will retry): {}", key.first,
               key.second, ranks.size(), Message(reply.status()));
    return false;
  }
  if (reply->outcome == group::Outcome::kCommitted || reply->outcome == group::Outcome::kAborted) {
    Apply(key, attempt, *reply);
  }
  return true;
}

void GroupCommitter::EnsureWatcherLocked(const Key& key) {
  Watch& w = watches_[key];
  if (w.since == Clock::time_point{}) w.since = Clock::now();
  if (stopping_ || !watched_.insert(key).second) return;  // one watcher per step
  ++watchers_;
  // Detached, counted: Shutdown waits for the count to reach zero.
  std::thread([this, key] { WatchLoop(key); }).detach();
}

void GroupCommitter::WatchLoop(Key key) {
  // On a shared root a member publishes nothing: the coordinator does, before announcing a
  // commit, but a coordinator that restarted answers from its decision log first and
  // publishes when its own watcher applies the decision. A member that hears "committed"
  // before the step is there waits for it (up to the step timeout) rather than fail a step
  // that is about to be published.
  std::optional<Clock::time_point> unpublished_since;
  while (true) {
    std::set<uint32_t> unsent;
    bool acknowledged = false, adopted = false, released = false;
    uint64_t attempt = 0;
    Clock::time_point since;
    {
      std::unique_lock lock(mu_);
      if (stopping_) break;
      auto w = watches_.find(key);
      if (w == watches_.end()) break;  // decided
      acknowledged = w->second.acknowledged;
      adopted = w->second.adopted;
      released = w->second.released;
      since = w->second.since;
      attempt = w->second.attempt;
      unsent = TakeReadyLocked(key, attempt);
    }
    if (!unsent.empty() && !SendPrepare(key, attempt, unsent)) {
      std::unique_lock lock(mu_);
      watch_cv_.wait_for(lock, kRetryPause, [&] { return stopping_; });
    } else {
      // A step in doubt has no snapshots left to build its manifest from: it asks for
      // the whole one and cuts its own ranks from it.
      auto decision = client_.GetOutcome(key.first, key.second, kOutcomePoll, adopted || released, attempt);
      if (decision.ok()) {
        // Only once the coordinator has seen this attempt (or this node no longer holds
        // it) is an answer about it: before its first prepare, "aborted" is about an
        // earlier attempt at the step. "Unknown" although the coordinator saw the prepare
        // (or this node gave up waiting, long after the coordinator's own step timeout):
        // it restarted before deciding (presumed abort).
        const bool seen = acknowledged || adopted || released;
        bool decided = seen && (decision->outcome == group::Outcome::kCommitted ||
                                decision->outcome == group::Outcome::kAborted ||
                                decision->outcome == group::Outcome::kUnknown);
        if (decided && decision->outcome == group::Outcome::kCommitted && store_.shared() && node_rank_ != 0 &&
            !store_.Committed(key.first, key.second)) {
          if (!unpublished_since) unpublished_since = Clock::now();
          if (Clock::now() - *unpublished_since < options_.step_timeout) {
            std::unique_lock lock(mu_);
            watch_cv_.wait_for(lock, kRetryPause, [&] { return stopping_; });
            continue;
          }
        }
        if (decided) {
          Apply(key, attempt, *decision);
          continue;
        }
      } else {
        std::unique_lock lock(mu_);
        watch_cv_.wait_for(lock, kRetryPause, [&] { return stopping_; });
      }
    }
    double waited = std::chrono::duration<double>(Clock::now() - since).count();
    // The coordinator's own step timeout decides first whenever it can be reached; this
    // node gives its memory back only when it cannot hear the decision.
    if (!released && !adopted &&
        Clock::now() - since > options_.step_timeout + std::chrono::seconds(10)) {
      ReleaseInDoubt(key, waited);
    }
  }
  std::lock_guard lock(mu_);
  watched_.erase(key);
  --watchers_;
  watch_cv_.notify_all();
}

void GroupCommitter::ReleaseInDoubt(const Key& key, double waited_s) {
  {
    std::lock_guard lock(mu_);
    auto w = watches_.find(key);
    if (w == watches_.end()) return;
    w->second.released = true;
  }
  metrics::Metrics().Fail(metrics::Cause::kTimeout);
  FinishAborted(key,
                fmt::format("outcome unknown: the coordinator has not decided step {} after {:.0f} "
                            "s; this node keeps its shards and commits or removes them when it "
                            "hears the decision",
                            key.second, waited_s),
                /*keep_tmp=*/true);
}

void GroupCommitter::Apply(const Key& key, uint64_t attempt, const group::Decision& decision) {
  bool ours = false;  // the step in the table is the attempt decided
  // A commit without the whole manifest is published by a node that no longer holds its
  // snapshots (it restarted, or released the step in doubt) from the record of what it
  // prepared; without one, its watcher asks for the whole manifest.
  bool recorded = false;
  if (decision.outcome == group::Outcome::kCommitted && decision.committed->manifest_json.empty() &&
      !HoldsAttempt(key, attempt)) {
    auto prepared = store_.LoadPrepared(key.first, key.second);
    recorded = prepared.ok() && prepared->has_value();
  }
  {
    std::lock_guard lock(mu_);
    auto step = steps_.find(key);
    auto watch = watches_.find(key);
    ours = step != steps_.end() && step->second.attempt == attempt;
    bool watched = watch != watches_.end() && watch->second.attempt == attempt;
    // The I/O thread (prepare reply) and the watcher (outcome poll) may both hear it.
    if (applying_.count(key) || (!ours && !watched)) return;
    if (!ours && !recorded && decision.outcome == group::Outcome::kCommitted &&
        decision.committed->manifest_json.empty()) {
      return;
    }
    // A newer attempt at the same step is writing: leave its directory alone.
    if (!ours && step != steps_.end()) {
      watches_.erase(watch);
      return;
    }
    applying_.insert(key);
    if (watched) {
      // The group's round as this node saw it: from its first rank durable to the decision.
      if (watch->second.since != Clock::time_point{}) {
        metrics::Metrics().commit_seconds.With({"group"}).Observe(
            std::chrono::duration<double>(Clock::now() - watch->second.since).count());
      }
      watches_.erase(watch);
    }
  }
  struct Done {
    GroupCommitter* self;
    Key key;
    ~Done() {
      std::lock_guard lock(self->mu_);
      self->applying_.erase(key);
    }
  } done{this, key};
  if (decision.outcome != group::Outcome::kCommitted) {
    std::string why = decision.reason.empty() ? "aborted by the coordinator" : decision.reason;
    if (why.rfind("aborted", 0) != 0) why = "aborted: " + why;
    if (ours) {
      metrics::Metrics().Fail(metrics::Cause::kGroup);
      FinishAborted(key, why);
    } else {
      DiscardUnfinished(key);  // a step in doubt: only its files are left
    }
    return;
  }
  absl::StatusOr<format::Manifest> manifest = Publishable(key, *decision.committed);
  if (absl::IsNotFound(manifest.status())) {
    // The commit is of other bytes than these (a new run saved the step number again) or
    // gives this node no ranks: these files are not part of any commit, and are removed.
    Log().warn("[{} s{}] {}: removing this node's files of the step", key.first, key.second,
               Message(manifest.status()));
    if (ours) {
      metrics::Metrics().Fail(metrics::Cause::kGroup);
      FinishAborted(key, fmt::format("aborted: {}", Message(manifest.status())));
    } else {
      DiscardUnfinished(key);
    }
    return;
  }
  absl::Status published = manifest.status();
  if (published.ok() && !store_.Committed(key.first, key.second)) {
    // On a shared root the coordinator publishes the step before announcing it, and
    // again (here, on node 0) when it restarted in between.
    if (store_.shared() && node_rank_ != 0) {
      published = absl::DataLossError("the coordinator did not publish it on the shared root");
    } else {
      // An index from the decision log names parts written before a restart: each is read
      // back and checked before the step is published over them.
      published = store_.CheckStagedParts(*manifest);
      if (published.ok()) published = store_.Commit(*manifest);
    }
  }
  if (absl::IsNotFound(published) && !ours) {
    Log().warn("[{} s{}] {}: removing the files this node kept in doubt", key.first, key.second, Message(published));
    DiscardUnfinished(key);
    return;
  }
  if (!published.ok()) {
    Log().error("[{} s{}] committed globally, but not published here: {}", key.first, key.second,
                Message(published));
    if (ours) metrics::Metrics().Fail(metrics::Cause::kStorage);
    if (ours) FinishAborted(key,
                  fmt::format("step {} committed globally, but this node could not publish its "
                              "part: {}",
                              key.second, Message(published)),
                  /*keep_tmp=*/true);
    return;
  }
  if (ours) FinishCommitted(key, *manifest);
  Log().info("[{} s{}] committed (global decision applied on node {})", key.first, key.second,
             node_rank_);
}

absl::StatusOr<format::Manifest> GroupCommitter::Publishable(const Key& key, const group::CommittedStep& committed) {
  if (!committed.manifest_json.empty()) {
    // Node 0 publishes the whole step; a node that asked for it (in doubt) cuts its own.
    CKPT_ASSIGN_OR_RETURN(format::Manifest whole,
                          format::ParseManifest(committed.manifest_json, "the coordinator's decision"));
    if (whole.scope) return absl::DataLossError("the coordinator's whole manifest is one node's part");
    CKPT_RETURN_IF_ERROR(CheckWhole(key, committed, whole));
    if (!store_.shared() && !HoldsAttempt(key, 0)) CKPT_RETURN_IF_ERROR(CheckRecordedBytes(key, committed, whole));
    if (node_rank_ == 0 || store_.shared()) {
      // An index names parts the coordinator wrote into the shared step directory: only
      // there can it be published.
      if (whole.index && !store_.shared()) {
        return absl::DataLossError("the coordinator sent an index of parts, which only a shared root holds");
      }
      return whole;
    }
    if (whole.index) return absl::DataLossError("the coordinator sent an index for a node's own ranks");
    format::Manifest mine =
        group::NodeManifestFromWhole(whole, committed.header.digest, node_rank_);
    if (mine.shards.empty()) {
      // Files of an attempt the commit does not include (the job saved the step again
      // without this node): not part of the step.
      return absl::NotFoundError(fmt::format("the commit of step {} gives this node no ranks", key.second));
    }
    return mine;
  }
  // Every other node: the manifest of its own durable ranks, as it prepared them, with the
  // step's header. The commit's share of this node must be what it wrote.
  if (!HoldsAttempt(key, 0)) return FromPreparedRecord(key, committed);
  absl::StatusOr<format::Manifest> part;
  uint64_t attempt = 0;
  {
    std::lock_guard lock(mu_);
    auto step = steps_.find(key);
    if (step == steps_.end()) return absl::FailedPreconditionError("this node no longer holds the step's snapshots");
    attempt = step->second.attempt;
    part = BuildManifest(key.first, key.second, step->second.world_size, step->second.durable);
  }
  CKPT_RETURN_IF_ERROR(part.status());
  return ScopedToCommit(committed, std::move(*part), attempt, fmt::format("this node's attempt {}", attempt));
}

absl::StatusOr<format::Manifest> GroupCommitter::ScopedToCommit(const group::CommittedStep& committed,
                                                               format::Manifest part, uint64_t attempt,
                                                               const std::string& source) {
  const group::StepHeader& header = committed.header;
  if (header.world_size != part.world_size) {
    return absl::DataLossError(fmt::format("the coordinator committed world size {}, {} has world size {}",
                                           header.world_size, source, part.world_size));
  }
  CKPT_RETURN_IF_ERROR(CheckBoundTo({part.job, part.step}, committed, part.run, attempt, source));
  group::NodeShare written{0, 0, attempt, part.run};
  for (const format::ManifestShard& s : part.shards) {
    ++written.ranks;
    written.bytes += s.bytes;
  }
  auto share = committed.shares.find(node_rank_);
  group::NodeShare given = share == committed.shares.end() ? group::NodeShare{} : share->second;
  // Not known on one side: a decision read back from the log, or a record read from disk
  // (CheckBoundTo compared what both sides know).
  given.attempt = written.attempt;
  given.run = written.run;
  if (given != written) {
    return absl::DataLossError(fmt::format(
        "the coordinator committed {} ranks ({} bytes) of this node (node {}); {} holds {} ranks ({} bytes)",
        given.ranks, given.bytes, node_rank_, source, written.ranks, written.bytes));
  }
  format::Manifest mine = group::NodeManifest(std::move(part), header, node_rank_);
  // Whatever the wire said, what is renamed into place must read back.
  CKPT_RETURN_IF_ERROR(format::ParseManifest(format::ManifestToJson(mine), "this node's manifest").status());
  return mine;
}

absl::Status GroupCommitter::CheckBoundTo(const Key& key, const group::CommittedStep& committed, uint64_t run,
                                          uint64_t attempt, const std::string& source) const {
  auto share = committed.shares.find(node_rank_);
  const group::NodeShare given = share == committed.shares.end() ? group::NodeShare{} : share->second;
  // A record of an older coordinator knows only the step's run, the newest of its parts':
  // these ranks cannot be of a later run than that.
  const bool other_run = given.run != 0 ? given.run != run : run > committed.header.run;
  const bool other_attempt = given.attempt != 0 && attempt != 0 && given.attempt != attempt;
  if (!other_run && !other_attempt) return absl::OkStatus();
  return absl::NotFoundError(fmt::format(
      "the coordinator's commit of step {} of job {} is of other bytes than {}: it holds this node's (node {}) "
      "ranks of run {}, attempt {}; {} is of run {}, attempt {} (a new run saved the step number again)",
      key.second, key.first, source, node_rank_, given.run != 0 ? given.run : committed.header.run,
      given.attempt != 0 ? fmt::format("{}", given.attempt) : "not recorded", source, run,
      attempt != 0 ? fmt::format("{}", attempt) : "not recorded"));
}

namespace {

// The first difference between the bytes `commit` and `recorded` describe of the same
// ranks (files, sizes, and every tensor entry's and train-state entry's checksums), as a
// sentence; empty when they describe the same bytes.
std::string FirstDifference(const format::Manifest& commit, const format::Manifest& recorded) {
  if (commit.shards.size() != recorded.shards.size()) {
    return fmt::format("the commit lists {} of this node's ranks, the record {}", commit.shards.size(),
                       recorded.shards.size());
  }
  for (const format::ManifestShard& r : recorded.shards) {
    const format::ManifestShard* c = commit.Shard(r.rank);
    if (c == nullptr) return fmt::format("the commit does not list rank {}", r.rank);
    if (c->file != r.file || c->bytes != r.bytes) {
      return fmt::format("rank {}'s shard is {} ({} bytes) in the commit, {} ({} bytes) in the record", r.rank,
                         c->file, c->bytes, r.file, r.bytes);
    }
    for (const auto& [name, entry] : r.train_state) {
      auto other = c->train_state.find(name);
      if (other == c->train_state.end() || other->second.checksum != entry.checksum) {
        return fmt::format("rank {}'s train state '{}' differs", r.rank, name);
      }
    }
    if (c->train_state.size() != r.train_state.size()) return fmt::format("rank {}'s train state differs", r.rank);
  }
  if (commit.tensors.size() != recorded.tensors.size()) {
    return fmt::format("the commit lists {} tensors of this node's ranks, the record {}", commit.tensors.size(),
                       recorded.tensors.size());
  }
  for (const auto& [name, tensor] : recorded.tensors) {
    auto other = commit.tensors.find(name);
    if (other == commit.tensors.end() || other->second.shards.size() != tensor.shards.size()) {
      return fmt::format("tensor '{}' is not the same in the commit", name);
    }
    for (size_t i = 0; i < tensor.shards.size(); ++i) {
      const format::TensorShard& r = tensor.shards[i];
      const format::TensorShard& c = other->second.shards[i];
      if (c.rank != r.rank || c.begin != r.begin || c.end != r.end || c.checksum != r.checksum ||
          c.chunk_checksums != r.chunk_checksums) {
        return fmt::format("rank {}'s piece of tensor '{}' has checksum {} in the commit, {} in the record", r.rank,
                           name, c.checksum, r.checksum);
      }
    }
  }
  return "";
}

}  // namespace

absl::Status GroupCommitter::CheckRecordedBytes(const Key& key, const group::CommittedStep& committed,
                                                const format::Manifest& whole) {
  const std::string source = "this node's record of what it prepared";
  CKPT_ASSIGN_OR_RETURN(std::optional<format::Manifest> recorded, store_.LoadPrepared(key.first, key.second));
  if (!recorded) {
    // Recorded before every prepare: a node that holds no record never prepared these
    // files, and no commit can be of them.
    return absl::NotFoundError(
        fmt::format("this node holds no record of having prepared step {}: the commit is not of its files", key.second));
  }
  CKPT_RETURN_IF_ERROR(CheckBoundTo(key, committed, recorded->run, /*attempt=*/0, source));
  const format::Manifest mine = group::NodeManifestFromWhole(whole, committed.header.digest, node_rank_);
  if (std::string difference = FirstDifference(mine, *recorded); !difference.empty()) {
    return absl::NotFoundError(fmt::format("the coordinator's commit of step {} is of other bytes than {}: {}",
                                           key.second, source, difference));
  }
  return absl::OkStatus();
}

bool GroupCommitter::HoldsAttempt(const Key& key, uint64_t attempt) {
  std::lock_guard lock(mu_);
  auto step = steps_.find(key);
  return step != steps_.end() && (attempt == 0 || step->second.attempt == attempt);
}

absl::StatusOr<format::Manifest> GroupCommitter::FromPreparedRecord(const Key& key,
                                                                   const group::CommittedStep& committed) {
  CKPT_ASSIGN_OR_RETURN(std::optional<format::Manifest> prepared, store_.LoadPrepared(key.first, key.second));
  if (!prepared) return absl::FailedPreconditionError("this node no longer holds the step's snapshots");
  auto share = committed.shares.find(node_rank_);
  if (share == committed.shares.end() || share->second.ranks == 0) {
    // Files of an attempt the commit does not include: not part of the step.
    return absl::NotFoundError(fmt::format("the commit of step {} gives this node no ranks", key.second));
  }
  return ScopedToCommit(committed, std::move(*prepared), /*attempt=*/0, "this node's record of what it prepared");
}

absl::Status GroupCommitter::CheckWhole(const Key& key, const group::CommittedStep& committed,
                                        const format::Manifest& manifest) {
  if (manifest.job != key.first || manifest.step != key.second) {
    return absl::DataLossError(fmt::format(
        "the coordinator answered for job {} step {} with the manifest of job {} step {}",
        key.first, key.second, manifest.job, manifest.step));
  }
  std::lock_guard lock(mu_);
  auto step = steps_.find(key);
  if (step == steps_.end()) return absl::OkStatus();  // in doubt: nothing here to compare
  if (auto share = committed.shares.find(node_rank_); share != committed.shares.end() && share->second.attempt != 0 &&
                                                      share->second.attempt != step->second.attempt) {
    return absl::NotFoundError(fmt::format("the coordinator's commit of step {} is of this node's attempt {}, not of "
                                           "its attempt {} (the step number was saved again)",
                                           key.second, share->second.attempt, step->second.attempt));
  }
  if (manifest.world_size != step->second.world_size) {
    return absl::DataLossError(fmt::format("the coordinator committed world size {}, this node's "
                                           "ranks have world size {}",
                                           manifest.world_size, step->second.world_size));
  }
  // Every rank this node made durable must be listed as held here with the file written:
  // otherwise the commit describes files this node does not hold.
  for (const auto& [rank, entry] : step->second.durable) {
    std::optional<uint32_t> holder = manifest.NodeOf(rank);
    const persist::WrittenShard& written = entry.second;
    // An index lists no shards (its parts do, each checked where it is read): the rank's
    // node is what it says of it.
    const format::ManifestShard* listed = manifest.Shard(rank);
    if (holder != node_rank_ || (!manifest.index && (listed == nullptr || listed->bytes != written.bytes))) {
      return absl::DataLossError(fmt::format(
          "the coordinator's manifest does not list rank {} as this node's (node {}) shard of "
          "{} bytes",
          rank, node_rank_, written.bytes));
    }
  }
  return absl::OkStatus();
}

void GroupCommitter::OnLocalFailure(const Key& key, const std::string& message) {
  bool foreign_dir = false, committed_dir = false;
  uint64_t attempt = 0, run = 0;
  {
    std::lock_guard lock(mu_);
    auto step = steps_.find(key);
    if (step == steps_.end()) return;  // already ended
    foreign_dir = step->second.foreign_dir;
    committed_dir = step->second.committed_dir;
    attempt = step->second.attempt;
    for (const StagedSnapshotPtr& s : step->second.waiting) run = std::max(run, s->session_started_unix_ns);
  }
  if (committed_dir) {
    // A new run saves a step number whose earlier checkpoint this node still holds: the
    // other nodes may have none left and would commit the new step without this node's
    // ranks, or wait for them until the step timeout. The coordinator ends the step for
    // every rank, with this reason (the abort carries the run, newer than the commit's).
    if (absl::Status told = client_.Abort(key.first, key.second, attempt, run, message); !told.ok()) {
      Log().warn("[{} s{}] could not tell the coordinator about the refusal: {}", key.first, key.second,
                 Message(told));
    }
  }
  if (foreign_dir) {
    // Refused a directory that a step in doubt (or a committed step) owns: only this
    // attempt ends; the other step's files and watch are not this attempt's to touch.
    FinishAborted(key, message, /*keep_tmp=*/true);
    return;
  }
  // The coordinator names this node in the reason it announces.
  if (absl::Status told = client_.Abort(key.first, key.second, attempt, /*run=*/0, message); !told.ok()) {
    Log().warn("[{} s{}] could not tell the coordinator about the failure: {}", key.first,
               key.second, Message(told));
  }
  {
    std::lock_guard lock(mu_);
    if (auto w = watches_.find(key); w != watches_.end() && w->second.attempt == attempt) {
      watches_.erase(w);
    }
  }
  FinishAborted(key, message);
}

void GroupCommitter::Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) {
  // The refusal comes on the trainer's command thread, which must not wait on the
  // network: the step ends on a thread of its own (detached, counted as a watcher:
  // Shutdown waits for it). One per step at a time, and a few in all: a trainer that
  // sends bad commands in a loop cannot make threads without end (beyond, its steps end
  // at the step timeout, as before).
  const Key key{job, step};
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;  // undecided steps fail their tickets at shutdown anyway
    if (refusing_.size() >= kMaxRefusing || !refusing_.insert(key).second) {
      Log().warn("[{} s{}] a rank's refusal is not acted on now ({} refusals being handled): the step ends at "
                 "its timeout",
                 job, step, refusing_.size());
      return;
    }
    ++watchers_;
  }
  auto done = [this, key] {
    std::lock_guard lock(mu_);
    refusing_.erase(key);
    --watchers_;
    watch_cv_.notify_all();
  };
  try {
    std::thread([this, job, step, rank, why, done] {
      CommitterBase::Refused(job, step, rank, why);
      done();
    }).detach();
  } catch (const std::system_error& e) {
    Log().error("[{} s{}] no thread to end the step after a rank's refusal: {}", job, step, e.what());
    done();
  }
}

void GroupCommitter::OnRefusedBeforeArrival(const Key& key, const std::string& message) {
  // The other nodes' ranks of the step may be prepared, or on their way: the coordinator
  // ends the step for all of them. A fresh attempt number, so that it is never taken for a
  // late word of an older attempt.
  uint64_t attempt;
  {
    std::lock_guard lock(mu_);
    attempt = ++attempts_;
  }
  if (absl::Status told = client_.Abort(key.first, key.second, attempt, /*run=*/0, message); !told.ok()) {
    Log().warn("[{} s{}] could not tell the coordinator about the refusal: {}", key.first, key.second,
               Message(told));
  }
}

void GroupCommitter::DiscardUnfinished(const Key& key) {
  // A shared step directory holds other nodes' shards too: the coordinator removes it.
  if (!store_.shared()) (void)store_.AbortStep(key.first, key.second);
}

absl::Status GroupCommitter::CheckStepAllowed(const Key& key) {
  std::lock_guard lock(mu_);
  auto w = watches_.find(key);
  if (w != watches_.end() && (w->second.adopted || w->second.released)) {
    return absl::FailedPreconditionError(fmt::format(
        "step {} of job {} is in doubt: this node holds it from before and has not yet heard the "
        "coordinator's decision",
        key.second, key.first));
  }
  return absl::OkStatus();
}

void GroupCommitter::AdoptInDoubt(const std::vector<std::pair<std::string, uint64_t>>& steps) {
  std::lock_guard lock(mu_);
  for (const auto& key : steps) {
    Watch& w = watches_[key];
    w.adopted = true;
    w.since = Clock::now();
    Log().info("[{} s{}] found in .tmp at start-up: asking the coordinator for its outcome",
               key.first, key.second);
    EnsureWatcherLocked(key);
  }
}

std::vector<StepInFlight> GroupCommitter::InFlight() const {
  std::vector<StepInFlight> out = CommitterBase::InFlight();
  auto now = Clock::now();
  std::lock_guard lock(mu_);
  for (const auto& [key, w] : watches_) {
    if (!w.adopted && !w.released) continue;
    out.push_back({key.first, key.second, 0, {},
                   std::chrono::duration<double>(now - w.since).count(), "in doubt"});
  }
  return out;
}

void GroupCommitter::Shutdown() {
  {
    std::unique_lock lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    watch_cv_.notify_all();
    // A watcher in a long poll returns within kOutcomePoll plus the RPC deadline.
    watch_cv_.wait(lock, [this] { return watchers_ == 0; });
  }
  std::vector<std::pair<Key, bool>> unfinished;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, step] : steps_) {
      auto w = watches_.find(key);
      unfinished.emplace_back(key, w != watches_.end() && w->second.acknowledged);
    }
  }
  for (const auto& [key, prepared] : unfinished) {
    // A prepared step may be committed by the others: its .tmp stays for the next start.
    FinishAborted(key,
                  fmt::format("ckptd shut down before step {} was decided", key.second),
                  /*keep_tmp=*/prepared);
  }
}

}  // namespace ckpt::daemon::commit
