#include "daemon/replicate/replicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <span>
#include <utility>

#include "common/log.h"
#include "common/status.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/replicate/run_each.h"
#include "daemon/replicate/shard_fragments.h"

namespace ckpt::replicate {
namespace {

// Steps remembered per job for `ckptctl status`: the one being sent, and those before.
constexpr size_t kStepsKeptPerJob = 4;
// How long a step's first send waits for the group's view to show every holder alive.
constexpr auto kViewSettle = std::chrono::seconds(5);

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

}  // namespace

const char* StateName(StepReplication::State state) {
  switch (state) {
    case StepReplication::State::kSending: return "sending";
    case StepReplication::State::kReplicated: return "replicated";
    case StepReplication::State::kIncomplete: return "incomplete";
  }
  return "?";
}

Replicator::Replicator(PeerDirectory& peers, ErasureCode code, int threads, std::function<void()> yield)
    : peers_(peers),
      code_(std::move(code)),
      threads_(std::max(threads, 1)),
      yield_(std::move(yield)),
      worker_([this] { Loop(); }) {}

Replicator::~Replicator() { Stop(); }

void Replicator::Stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Replicator::Staged(const std::string& job, uint64_t step, uint32_t rank, uint64_t run, uid_t uid,
                        std::shared_ptr<const ScatteredBytes> data, uint64_t bytes) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    // A newer step makes the queued shards of older steps not begun moot (and their staging
    // memory is better given back): the newer step replaces them in the peers anyway. A step
    // already being sent is finished, so that a group slower than the checkpoint interval
    // still replicates every other step or so rather than none.
    for (auto it = queue_.begin(); it != queue_.end();) {
      const Key older{it->job, it->step};
      auto record = records_.find(older);
      const bool begun = older == sending_ || (record != records_.end() && !record->second.sent.empty());
      const bool superseded = std::pair{it->run, it->step} < std::pair{run, step};
      if (it->job == job && it->step != step && superseded && !begun) {
        MarkIncompleteLocked(records_[{it->job, it->step}],
                             fmt::format("step {} was staged before this one's shards were sent", step), "superseded");
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    Record& r = records_[{job, step}];
    if (!r.status.job.empty() && r.run != run && r.status.state != StepReplication::State::kSending) {
      r = Record{};  // the same step number saved again by a newer run: a step of its own
    }
    if (r.status.job.empty()) {
      r.status.job = job;
      r.status.step = step;
      r.started = std::chrono::steady_clock::now();
    }
    r.run = run;
    queue_.push_back(Shard{job, step, rank, run, uid, std::move(data), bytes});
    PruneLocked();
  }
  wake_.notify_all();
}

void Replicator::Committed(const std::string& job, uint64_t step, std::vector<uint32_t> ranks,
                           std::string manifest_json, double unix_time) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    Record& r = records_[{job, step}];
    if (r.status.job.empty()) {
      r.status.job = job;
      r.status.step = step;
      r.started = std::chrono::steady_clock::now();
    }
    r.committed_ranks = std::move(ranks);
    r.manifest_json = std::move(manifest_json);
    r.status.unix_time = unix_time;
    if (!ReadyLocked(r)) return;
    to_finish_.push_back({job, step});
  }
  wake_.notify_all();
}

void Replicator::Failed(const std::string& job, uint64_t step) {
  {
    std::lock_guard lock(mu_);
    auto it = records_.find({job, step});
    if (it == records_.end()) return;  // nothing of it was staged here
    Record& r = it->second;
    r.failed = true;
    MarkIncompleteLocked(r, "the step did not commit", {});  // counted as the step's failure
    queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                [&](const Shard& s) { return s.job == job && s.step == step; }),
                 queue_.end());
    if (!r.holders) return;  // nothing sent: nothing for the peers to drop
    to_finish_.push_back({job, step});
  }
  wake_.notify_all();
}

bool Replicator::ReadyLocked(const Record& r) const {
  if (r.sealing) return false;
  if (r.failed) return true;
  if (!r.committed_ranks) return false;
  for (uint32_t rank : *r.committed_ranks) {
    if (!r.sent.count(rank)) {
      // Not sent yet, and not about to be: given up (superseded) without a result.
      const bool queued = std::any_of(queue_.begin(), queue_.end(), [&](const Shard& s) {
        return s.job == r.status.job && s.step == r.status.step && s.rank == rank;
      });
      if (queued || r.status.state != StepReplication::State::kIncomplete) return false;
    }
  }
  return true;
}

void Replicator::MarkIncompleteLocked(Record& r, std::string why, std::string_view cause) {
  if (r.status.state == StepReplication::State::kIncomplete) return;
  r.status.state = StepReplication::State::kIncomplete;
  r.status.why = std::move(why);
  if (!cause.empty()) metrics::Metrics().ReplicationError(cause);
  Log().warn("[{} s{}] not replicated: {}", r.status.job, r.status.step, r.status.why);
}

void Replicator::PruneLocked() {
  std::map<std::string, size_t> kept;
  for (auto it = records_.rbegin(); it != records_.rend();) {
    const bool old = ++kept[it->first.first] > kStepsKeptPerJob;
    // A step still being sent or sealed stays: the worker comes back to its record.
    const bool busy = it->second.sealing || it->second.status.state == StepReplication::State::kSending;
    if (old && !busy) {
      it = std::make_reverse_iterator(records_.erase(std::next(it).base()));
    } else {
      ++it;
    }
  }
}

std::vector<StepReplication> Replicator::Steps() const {
  std::lock_guard lock(mu_);
  std::vector<StepReplication> out;
  for (const auto& [key, r] : records_) out.push_back(r.status);
  return out;
}

bool Replicator::Replicated(const std::string& job, uint64_t step) const {
  std::lock_guard lock(mu_);
  // The newest replicated step of the job, by run and then step.
  const Record* newest = nullptr;
  for (auto it = records_.lower_bound({job, 0}); it != records_.end() && it->first.first == job; ++it) {
    const Record& r = it->second;
    if (r.status.state != StepReplication::State::kReplicated) continue;
    if (newest == nullptr || std::pair{r.run, r.status.step} > std::pair{newest->run, newest->status.step}) newest = &r;
  }
  return newest != nullptr && newest->status.step == step;
}

void Replicator::Loop() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty() || !to_finish_.empty(); });
    if (stopping_) return;
    if (!to_finish_.empty()) {
      Key key = to_finish_.front();
      to_finish_.pop_front();
      auto it = records_.find(key);
      if (it == records_.end() || it->second.sealing) continue;
      it->second.sealing = true;
      lock.unlock();
      Finish(key);
      lock.lock();
      if (auto done = records_.find(key); done != records_.end()) done->second.sealing = false;
      continue;
    }
    Shard shard = std::move(queue_.front());
    queue_.pop_front();
    const Key key{shard.job, shard.step};
    sending_ = key;
    Record& r = records_[key];
    if (r.status.job.empty()) {  // pruned while its shard waited
      r.status.job = key.first;
      r.status.step = key.second;
      r.started = std::chrono::steady_clock::now();
    }
    std::optional<std::vector<Holder>> holders = r.holders;
    if (!holders) {
      lock.unlock();
      absl::StatusOr<std::vector<Holder>> found = WaitForHolders();
      lock.lock();
      auto again = records_.find(key);  // the lock was let go: look it up again
      if (again == records_.end()) {
        sending_.reset();
        continue;
      }
      if (found.ok()) {
        holders = *found;
        again->second.holders = holders;
      } else {
        MarkIncompleteLocked(again->second, Message(found.status()), metrics::ErrorCause(found.status()));
        holders = std::vector<Holder>{};  // nothing is sent: the step is incomplete
      }
    }
    absl::Status sent;
    Sent result;
    if (auto it = records_.find(key); it != records_.end() && it->second.status.state == StepReplication::State::kIncomplete) {
      sent = absl::AbortedError(it->second.status.why);
    } else {
      std::shared_ptr<const Base> base;
      if (auto b = bases_.find({shard.job, shard.rank}); b != bases_.end()) base = b->second;
      lock.unlock();
      try {
        sent = Send(shard, *holders, base, result);
      } catch (const std::exception& e) {  // coding's buffers out of memory: this step only
        sent = absl::ResourceExhaustedError(fmt::format("coding the shard: {}", e.what()));
      }
      shard.data.reset();  // the staging memory may go back before the lock is taken
      lock.lock();
    }
    sending_.reset();
    auto found_again = records_.find(key);
    if (found_again == records_.end()) continue;
    Record& done = found_again->second;
    done.status.bytes_sent += result.bytes;
    done.status.bytes_unchanged += result.unchanged;
    metrics::Metrics().replication_sent_bytes.With({}).Add(static_cast<double>(result.bytes));
    metrics::Metrics().replication_unchanged_bytes.With({}).Add(static_cast<double>(result.unchanged));
    if (sent.ok() && result.next) done.coded[shard.rank] = result.next;
    if (!sent.ok()) {
      MarkIncompleteLocked(done, fmt::format("rank {}: {}", shard.rank, Message(sent)), metrics::ErrorCause(sent));
    }
    done.sent[shard.rank] = sent;
    if (ReadyLocked(done)) to_finish_.push_back(key);
  }
}

absl::StatusOr<std::vector<Holder>> Replicator::WaitForHolders() {
  // A member this node has not heard join yet (the view comes with heartbeats) may well be
  // in the step: it committed with every rank. Wait a little for the view to say so.
  const auto deadline = std::chrono::steady_clock::now() + kViewSettle;
  while (true) {
    absl::StatusOr<std::vector<Holder>> found = peers_.Holders(peers_.options().self);
    if (!found.ok() || std::chrono::steady_clock::now() >= deadline ||
        std::all_of(found->begin(), found->end(), [](const Holder& h) { return h.alive; })) {
      return found;
    }
    std::unique_lock lock(mu_);
    if (wake_.wait_for(lock, std::chrono::milliseconds(50), [&] { return stopping_; })) return found;
  }
}

absl::Status Replicator::Send(const Shard& shard, const std::vector<Holder>& holders,
                              const std::shared_ptr<const Base>& base, Sent& sent) {
  for (const Holder& h : holders) {
    if (!h.alive) return absl::UnavailableError(fmt::format("peer node {} is not in the group now", h.node));
  }
  const uint32_t self = peers_.options().self;
  const ScatteredBytes& data = *shard.data;
  auto next = std::make_shared<Base>();
  next->step = shard.step;
  next->run = shard.run;
  next->data_bytes = shard.bytes;
  for (const Holder& h : holders) next->holders.emplace_back(h.node, h.address);
  const size_t each = code_.FragmentBytes(shard.bytes);
  auto failed = [&](size_t i, const absl::Status& status) {
    return Annotate(status, fmt::format("sending fragment {} to node {} ({})", i, holders[i].node, holders[i].address));
  };
  // Holders that are to get their fragment whole: all of them, but those that took a patch.
  std::vector<size_t> whole;
  for (size_t i = 0; i < holders.size(); ++i) whole.push_back(i);
  // A patch of the step the holders hold: only where it is the same run's shard of the same
  // size, coded alike and held by the same holders (a holder that restarted has lost it).
  if (base != nullptr && base->step != shard.step && base->run == shard.run && base->data_bytes == shard.bytes &&
      base->holders == next->holders && base->sums.sums.size() == holders.size()) {
    if (yield_) yield_();
    absl::StatusOr<ShardPatch> patch =
        CodePatch(code_, shard.job, shard.step, self, shard.rank, shard.run, data, holders.size(), base->sums, threads_);
    if (!patch.ok()) {
      Log().warn("[{}/r{} s{}] sent whole, not as a patch of step {}: {}", shard.job, shard.rank, shard.step,
                 base->step, Message(patch.status()));
    } else {
      const FragmentPatch wire{base->step, patch->sums.chunk_bytes, patch->chunks};
      if (yield_) yield_();
      const std::vector<absl::Status> results = OnEachHolder(
          holders, [&](size_t i, ReplicaClient& peer) { return peer.PutPatch(shard.uid, patch->fragments[i], wire); });
      whole.clear();
      for (size_t i = 0; i < holders.size(); ++i) {
        const absl::Status& r = results[i];
        if (r.ok()) {
          sent.bytes += patch->fragments[i].bytes.size();
          sent.unchanged += each - patch->fragments[i].bytes.size();
          continue;
        }
        // A holder that is down or silent would not take the whole fragment either.
        if (absl::IsUnavailable(r) || absl::IsDeadlineExceeded(r) || absl::IsUnauthenticated(r)) return failed(i, r);
        // It lacks the base (it restarted, or dropped it), or the patch did not check out
        // there: the fragment goes whole.
        Log().info("[{}/r{} s{}] node {} took no patch of step {} ({}): fragment {} goes whole", shard.job,
                   shard.rank, shard.step, holders[i].node, base->step, Message(r), i);
        whole.push_back(i);
      }
      next->sums = std::move(patch->sums);
      if (whole.empty()) {
        sent.next = std::move(next);
        return absl::OkStatus();
      }
    }
  }
  if (yield_) yield_();
  CKPT_ASSIGN_OR_RETURN(std::vector<HeldFragment> fragments,
                        CodeShard(code_, shard.job, shard.step, self, shard.rank, shard.run, data, threads_));
  if (next->sums.sums.empty()) next->sums = SumsOf(fragments, holders.size(), kPatchChunkBytes, threads_);
  // One thread per holder (OnEachHolder): each peer's link runs at its own speed, and a
  // stalled peer costs the call's timeout once, not once per holder.
  if (yield_) yield_();
  std::vector<Holder> to;
  for (size_t i : whole) to.push_back(holders[i]);
  const std::vector<absl::Status> results =
      OnEachHolder(to, [&](size_t j, ReplicaClient& peer) { return peer.Put(shard.uid, fragments[whole[j]]); });
  for (size_t j = 0; j < whole.size(); ++j) {
    if (!results[j].ok()) return failed(whole[j], results[j]);
    sent.bytes += fragments[whole[j]].bytes.size();
  }
  sent.next = std::move(next);
  return absl::OkStatus();
}

void Replicator::Finish(const Key& key) {
  std::vector<Holder> holders;
  size_t count = 0;
  bool seal = false;
  std::string manifest;
  {
    std::lock_guard lock(mu_);
    auto it = records_.find(key);
    if (it == records_.end()) return;
    Record& r = it->second;
    if (!r.holders) {
      // Committed here with no shard staged by this daemon (a step in doubt across its
      // restart): nothing was sent, and nothing is claimed.
      MarkIncompleteLocked(r, "none of its shards was staged by this daemon", "other");
      return;
    }
    holders = *r.holders;
    seal = !r.failed && r.status.state != StepReplication::State::kIncomplete;
    count = r.committed_ranks ? r.committed_ranks->size() : 0;
    if (seal) manifest = r.manifest_json;
  }
  const uint32_t self = peers_.options().self;
  // Phase 1: every holder seals the step (restorable there), or, when it cannot be
  // replicated, drops what it got of it (a count of 0; a step sealed there stays).
  std::vector<absl::Status> results = OnEachHolder(holders, [&](size_t, ReplicaClient& peer) {
    return peer.Seal(key.first, key.second, self, seal ? count : 0, manifest);
  });
  if (seal) {
    for (size_t i = 0; i < holders.size(); ++i) {
      if (results[i].ok()) continue;
      {
        std::lock_guard lock(mu_);
        if (auto it = records_.find(key); it != records_.end()) {
          MarkIncompleteLocked(it->second, fmt::format("sealing with node {}: {}", holders[i].node, Message(results[i])),
                               metrics::ErrorCause(results[i]));
        }
      }
      // Sealed at some holders only: none drops the step before (no release), and those
      // that did not seal drop what they got.
      OnEachHolder(holders, [&](size_t, ReplicaClient& peer) { return peer.Seal(key.first, key.second, self, 0, {}); });
      return;
    }
  }
  if (!seal) return;
  std::vector<uint32_t> nodes;
  for (const Holder& h : holders) nodes.push_back(h.node);
  {
    std::lock_guard lock(mu_);
    auto it = records_.find(key);
    if (it == records_.end()) return;
    Record& r = it->second;
    r.status.state = StepReplication::State::kReplicated;
    r.status.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count();
    r.manifest_json.clear();
    Log().info("[{} s{}] replicated: {} bytes of fragments to nodes {} ({} unchanged, not sent) in {:.1f} ms",
               key.first, key.second, r.status.bytes_sent, fmt::join(nodes, ","), r.status.bytes_unchanged,
               r.status.seconds * 1e3);
  }
  // Phase 2: every holder has the step, so each may drop the ones before. A holder that
  // misses this keeps an older step until the next release.
  results = OnEachHolder(holders, [&](size_t, ReplicaClient& peer) { return peer.Release(key.first, key.second, self); });
  bool released = true;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (!results[i].ok()) {
      released = false;
      Log().warn("[{} s{}] node {} keeps this node's older steps: {}", key.first, key.second, holders[i].node,
                 Message(results[i]));
    }
  }
  // The holders now hold exactly this step (the older ones went where the release went
  // through): its shards are the bases of the next. Where a release failed, the holders hold
  // different steps, and the next step goes whole.
  std::lock_guard lock(mu_);
  for (auto it = bases_.lower_bound({key.first, 0}); it != bases_.end() && it->first.first == key.first;) {
    it = bases_.erase(it);
  }
  if (!released) return;
  auto it = records_.find(key);
  if (it == records_.end() || !it->second.committed_ranks) return;
  for (uint32_t rank : *it->second.committed_ranks) {
    if (auto coded = it->second.coded.find(rank); coded != it->second.coded.end()) {
      bases_[{key.first, rank}] = coded->second;
    }
  }
  it->second.coded.clear();
}

std::vector<absl::Status> Replicator::OnEachHolder(const std::vector<Holder>& holders,
                                                   const std::function<absl::Status(size_t, ReplicaClient&)>& call) {
  return RunEach(holders.size(), holders.size(), [&](size_t i) {
    if (!holders[i].alive) {
      return absl::UnavailableError(fmt::format("peer node {} is not in the group now", holders[i].node));
    }
    ReplicaClient peer = peers_.Client(holders[i].address);
    return call(i, peer);
  });
}

}  // namespace ckpt::replicate
