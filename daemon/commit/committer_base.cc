#include "daemon/commit/committer_base.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "common/log.h"
#include "common/status.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/persist/write_queue.h"

namespace ckpt::daemon::commit {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kPersist); }

// How long an aborted attempt's late ranks are refused; a rank of a session registered
// after the abort is a new attempt and is never refused.
constexpr std::chrono::minutes kRememberEnded{30};
constexpr size_t kMaxEnded = 4096;

}  // namespace

CommitterBase::CommitterBase(format::CheckpointStore& store, CommitHooks hooks,
                             CommitOptions options)
    : store_(store),
      hooks_(std::move(hooks)),
      options_(options),
      attempts_(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count())) {}

CommitterBase::Step* CommitterBase::CurrentStepLocked(const StagedSnapshotPtr& snapshot) {
  auto it = steps_.find({snapshot->job, snapshot->step});
  if (it == steps_.end()) return nullptr;
  const auto& waiting = it->second.waiting;
  return std::find(waiting.begin(), waiting.end(), snapshot) != waiting.end() ? &it->second
                                                                               : nullptr;
}

absl::Status CommitterBase::Arrived(const StagedSnapshotPtr& snapshot) {
  const Key key{snapshot->job, snapshot->step};
  std::lock_guard lock(mu_);
  auto now = Clock::now();
  ForgetOldEndedLocked(now);
  if (auto ended = ended_.find(key); ended != ended_.end()) {
    if (snapshot->session_started <= ended->second.when) {
      return absl::AbortedError(ended->second.why);
    }
    ended_.erase(ended);  // a trainer that registered since is trying the step again
  }
  auto [it, inserted] = steps_.try_emplace(key);
  Step& step = it->second;
  if (inserted) {
    step.world_size = snapshot->world_size;
    step.started = now;
    step.attempt = ++attempts_;
  }
  if (snapshot->world_size != step.world_size) {
    return absl::InvalidArgumentError(
        fmt::format("rank {} says world size {}, rank(s) before it said {}", snapshot->rank,
                    snapshot->world_size, step.world_size));
  }
  if (!step.arrived.insert(snapshot->rank).second) {
    return absl::AlreadyExistsError(
        fmt::format("rank {} submitted step {} twice", snapshot->rank, snapshot->step));
  }
  step.waiting.push_back(snapshot);
  return absl::OkStatus();
}

absl::StatusOr<std::string> CommitterBase::StepDirectory(const StagedSnapshotPtr& snapshot) {
  const Key key{snapshot->job, snapshot->step};
  std::shared_future<absl::Status> dir;
  std::promise<absl::Status> begin;
  bool first = false;
  {
    std::lock_guard lock(mu_);
    Step* step = CurrentStepLocked(snapshot);
    if (step == nullptr) return absl::AbortedError("the step already ended");
    if (!step->dir.valid()) {
      step->dir = begin.get_future().share();
      first = true;
    }
    dir = step->dir;
  }
  if (first) {
    absl::Status s = CheckStepAllowed(key);
    const bool committed = s.ok() && store_.Committed(key.first, key.second);
    if (committed) {
      s = absl::AlreadyExistsError(fmt::format(
          "step {} of job {} is already committed (its checkpoint, of an earlier run, is still on this node's disk): "
          "a step number is saved again only once its checkpoint is gone (ckptctl --job {} delete {})",
          key.second, key.first, key.first, key.second));
    }
    if (!s.ok()) {
      std::lock_guard lock(mu_);
      if (Step* step = CurrentStepLocked(snapshot)) {
        step->foreign_dir = true;
        step->committed_dir = committed;
      }
    } else {
      s = store_.BeginStep(key.first, key.second);
    }
    begin.set_value(s);
  }
  CKPT_RETURN_IF_ERROR(dir.get());
  return store_.TempStepKey(key.first, key.second);  // where the shard writer writes
}

void CommitterBase::Failed(const StagedSnapshotPtr& snapshot, const std::string& error) {
  {
    std::lock_guard lock(mu_);
    if (CurrentStepLocked(snapshot) == nullptr) return;  // its attempt ended; ticket told
  }
  OnLocalFailure({snapshot->job, snapshot->step}, error);
}

void CommitterBase::Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) {
  const Key key{job, step};
  const std::string message = fmt::format("a rank's snapshot was refused: {}", why);
  // The rank already arrived in this attempt: what was refused is a repeat, which the
  // attempt does not need (and a complete step may be committing).
  auto repeat_locked = [&] {
    auto it = steps_.find(key);
    return it != steps_.end() && it->second.arrived.count(rank) > 0;
  };
  bool was_in_flight;
  {
    std::lock_guard lock(mu_);
    if (repeat_locked()) return;
    was_in_flight = steps_.count(key) > 0;
  }
  if (!was_in_flight && store_.Committed(job, step)) return;  // a repeat of a committed step (I/O: unlocked)
  // Looked at again: the step may have begun meanwhile (its ranks then fail with it).
  bool in_flight;
  {
    std::lock_guard lock(mu_);
    if (repeat_locked()) return;
    in_flight = steps_.count(key) > 0;
    if (!in_flight) {
      // This attempt's ranks still to come are refused at once, and their memory with them.
      auto now = Clock::now();
      ForgetOldEndedLocked(now);
      ended_[key] = {now, message};
      // Bounded however many steps a trainer's bad commands name.
      while (ended_.size() > kMaxEnded) {
        ended_.erase(std::min_element(ended_.begin(), ended_.end(), [](const auto& a, const auto& b) {
          return a.second.when < b.second.when;
        }));
      }
    }
  }
  if (in_flight) {
    OnLocalFailure(key, message);
    return;
  }
  Log().error("[{} s{}] checkpoint failed: {}", key.first, key.second, message);
  hooks_.failed(key.first, key.second, message);
  OnRefusedBeforeArrival(key, message);
}

void CommitterBase::OnLocalFailure(const Key& key, const std::string& message) {
  FinishAborted(key, message);
}

void CommitterBase::FinishCommitted(const Key& key, const format::Manifest& manifest) {
  std::vector<StagedSnapshotPtr> waiting, local;
  {
    std::lock_guard lock(mu_);
    auto it = steps_.find(key);
    if (it == steps_.end()) return;
    waiting = std::move(it->second.waiting);
    for (auto& [rank, entry] : it->second.durable) local.push_back(entry.first);
    metrics::Metrics().commit_seconds.With({"node"}).Observe(
        std::chrono::duration<double>(Clock::now() - it->second.started).count());
    steps_.erase(it);
  }
  Log().info("[{} s{}] committed: {} ranks, {} bytes", key.first, key.second, manifest.world_size,
             manifest.StepBytes());
  hooks_.committed(manifest, local);  // hot before "committed": a restore then finds it
  local.clear();
  persist::NotifyTickets(waiting, shm::kTicketCommitted, "");
  waiting.clear();
  hooks_.progress();
}

void CommitterBase::FinishAborted(const Key& key, const std::string& message, bool keep_tmp) {
  std::vector<StagedSnapshotPtr> waiting;
  {
    std::lock_guard lock(mu_);
    ended_[key] = {Clock::now(), message};
    auto it = steps_.find(key);
    if (it == steps_.end()) return;
    waiting = std::move(it->second.waiting);
    keep_tmp = keep_tmp || it->second.foreign_dir;
    steps_.erase(it);
  }
  Log().error("[{} s{}] checkpoint failed: {}", key.first, key.second, message);
  hooks_.failed(key.first, key.second, message);
  // Only the unfinished step-N.tmp goes; a committed step-N is never touched.
  if (!keep_tmp) DiscardUnfinished(key);
  persist::NotifyTickets(waiting, shm::kTicketFailed, message);
  waiting.clear();  // the staging blocks return to the pool here
  hooks_.progress();
}

void CommitterBase::ForgetOldEndedLocked(Clock::time_point now) {
  for (auto it = ended_.begin(); it != ended_.end();) {
    it = now - it->second.when > kRememberEnded ? ended_.erase(it) : std::next(it);
  }
}

std::vector<StepInFlight> CommitterBase::InFlight() const {
  std::vector<StepInFlight> out;
  auto now = Clock::now();
  std::lock_guard lock(mu_);
  for (const auto& [key, step] : steps_) {
    StepInFlight s{key.first, key.second, step.world_size, {},
                   std::chrono::duration<double>(now - step.started).count(), step.state};
    for (uint32_t r = 0; r < step.world_size && s.missing_ranks.size() < 64; ++r) {
      if (!step.durable.count(r)) s.missing_ranks.push_back(r);
    }
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.age_s > b.age_s; });
  return out;
}

std::string CommitterBase::MissingRanks(uint32_t world_size, const std::set<uint32_t>& have) {
  std::vector<uint32_t> missing;
  for (uint32_t r = 0; r < world_size && missing.size() <= 16; ++r) {
    if (!have.count(r)) missing.push_back(r);
  }
  size_t shown = std::min<size_t>(missing.size(), 16);
  return fmt::format("{}{}", fmt::join(missing.begin(), missing.begin() + shown, ", "),
                     missing.size() > 16 ? ", ..." : "");
}

std::set<uint32_t> CommitterBase::Ranks(const DurableShards& shards) {
  std::set<uint32_t> ranks;
  for (const auto& [rank, entry] : shards) ranks.insert(rank);
  return ranks;
}

}  // namespace ckpt::daemon::commit
