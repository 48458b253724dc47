#include "daemon/commit/single_node_committer.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "daemon/metrics/daemon_metrics.h"
#include "common/log.h"
#include "common/status.h"
#include "format/tiling.h"

namespace ckpt::daemon::commit {

SingleNodeCommitter::SingleNodeCommitter(format::CheckpointStore& store, CommitHooks hooks,
                                         CommitOptions options)
    : CommitterBase(store, std::move(hooks), options) {
  timeouts_ = std::thread([this] { TimeoutLoop(); });
}

SingleNodeCommitter::~SingleNodeCommitter() { Shutdown(); }

void SingleNodeCommitter::Durable(const StagedSnapshotPtr& snapshot, persist::WrittenShard shard) {
  const Key key{snapshot->job, snapshot->step};
  bool complete = false;
  std::optional<uint64_t> newer;
  {
    std::lock_guard lock(mu_);
    Step* current = CurrentStepLocked(snapshot);
    if (current == nullptr) return;  // its attempt already ended and its ticket was told
    Step& step = *current;
    step.durable[snapshot->rank] = {snapshot, std::move(shard)};
    complete = step.durable.size() == step.world_size;
    // A newer step committed while this rank was being written: nothing more can arrive.
    if (auto latest = latest_committed_.find(key.first);
        !complete && latest != latest_committed_.end() && latest->second > key.second &&
        step.arrived.size() == step.durable.size()) {
      newer = latest->second;
    }
  }
  if (complete) Commit(key);
  if (newer) AbandonOlder({key.first, *newer});
}

void SingleNodeCommitter::Commit(const Key& key) {
  absl::StatusOr<format::Manifest> manifest;
  {
    std::lock_guard lock(mu_);
    auto it = steps_.find(key);
    if (it == steps_.end()) return;
    manifest = BuildManifest(key.first, key.second, it->second.world_size, it->second.durable);
  }
  // Ranks that disagree about who holds which part of a tensor make a step nobody could
  // restore: it fails here, naming the tensor, instead of committing.
  if (manifest.ok()) {
    if (absl::Status tiled = format::CheckTiling(*manifest); !tiled.ok()) manifest = tiled;
  }
  absl::Status committed = manifest.ok() ? store_.Commit(*manifest) : manifest.status();
  if (!committed.ok()) {
    metrics::Metrics().Fail(metrics::Cause::kStorage);
    FinishAborted(key, fmt::format("commit of step {} failed: {}", key.second, Message(committed)));
    return;
  }
  {
    std::lock_guard lock(mu_);
    uint64_t& latest = latest_committed_[key.first];
    latest = std::max(latest, key.second);
  }
  FinishCommitted(key, *manifest);
  AbandonOlder(key);
}

void SingleNodeCommitter::AbandonOlder(const Key& committed) {
  std::vector<std::pair<Key, uint32_t>> abandoned;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, step] : steps_) {
      // Older steps whose arrived ranks are all written can never complete now; one with a
      // rank still queued or being written may: leave it. So may one with every rank
      // written: its commit runs on the thread that wrote its last rank, maybe right now.
      if (key.first == committed.first && key.second < committed.second &&
          step.arrived.size() == step.durable.size() && step.durable.size() < step.world_size) {
        abandoned.emplace_back(key, step.world_size);
      }
    }
  }
  for (const auto& [key, world_size] : abandoned) {
    FinishAborted(key, fmt::format("step {} abandoned: step {} committed before all {} ranks of "
                                   "step {} arrived",
                                   key.second, committed.second, world_size, key.second));
  }
}

void SingleNodeCommitter::TimeoutLoop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    stop_cv_.wait_for(lock, std::chrono::milliseconds(200));
    std::vector<std::pair<Key, std::string>> expired;
    auto now = Clock::now();
    for (const auto& [key, step] : steps_) {
      // A step whose ranks have all arrived is being written: writing has no timeout here.
      if (now - step.started < options_.step_timeout || step.arrived.size() == step.world_size) {
        continue;
      }
      expired.emplace_back(
          key, fmt::format("aborted: step {} still missing ranks {} of {} after {:.1f} s "
                           "(--step-timeout)",
                           key.second, MissingRanks(step.world_size, step.arrived),
                           step.world_size, std::chrono::duration<double>(now - step.started).count()));
    }
    lock.unlock();
    for (const auto& [key, why] : expired) {
      metrics::Metrics().Fail(metrics::Cause::kTimeout);
      FinishAborted(key, why);
    }
    lock.lock();
  }
}

void SingleNodeCommitter::Shutdown() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    stop_cv_.notify_all();
  }
  timeouts_.join();
  std::vector<Key> unfinished;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, step] : steps_) unfinished.push_back(key);
  }
  for (const Key& key : unfinished) {
    FinishAborted(key, fmt::format("ckptd shut down before all ranks of step {} were written",
                                   key.second));
  }
}

}  // namespace ckpt::daemon::commit
