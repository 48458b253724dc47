#include "daemon/staging/hot_cache.h"

#include <algorithm>

#include "common/log.h"

namespace ckpt::daemon {

void HotCache::Insert(const std::vector<StagedSnapshotPtr>& committed) {
  std::vector<StagedSnapshotPtr> replaced;  // released outside the lock
  {
    std::lock_guard lock(mu_);
    for (const StagedSnapshotPtr& snap : committed) {
      snap->in_flight.reset();  // committed: no longer counted against the job's share
      StagedSnapshotPtr& slot = hot_[{snap->job, snap->rank}];
      if (!slot || slot->step < snap->step) {
        replaced.push_back(std::move(slot));
        slot = snap;
      }
    }
  }
  replaced.clear();
  progress_.Notify();
}

StagedSnapshotPtr HotCache::Find(const std::string& job, uint32_t rank, uint64_t step) const {
  StagedSnapshotPtr found;
  {
    std::lock_guard lock(mu_);
    auto it = hot_.find({job, rank});
    if (it == hot_.end() || it->second->step != step) return nullptr;
    found = it->second;
  }
  // Every writer waits for the last byte before its step commits, so this wait is for form:
  // what a snapshot whose copy failed holds is not in memory at all.
  if (found->shard.landed != nullptr && !found->shard.landed->WaitFor(found->shard.data_bytes).ok()) {
    return nullptr;
  }
  return found;
}

bool HotCache::EvictOne() {
  StagedSnapshotPtr victim;
  {
    std::lock_guard lock(mu_);
    auto oldest = hot_.end();
    for (auto it = hot_.begin(); it != hot_.end(); ++it) {
      if (oldest == hot_.end() || it->second->step < oldest->second->step) oldest = it;
    }
    if (oldest == hot_.end()) return false;
    victim = std::move(oldest->second);
    hot_.erase(oldest);
  }
  log::Get(log::Component::kStaging)
      .debug("[{}/r{} s{}] evicted from memory", victim->job, victim->rank, victim->step);
  victim.reset();
  progress_.Notify();
  return true;
}

void HotCache::Drop(const std::string& job, uint64_t step) {
  std::vector<StagedSnapshotPtr> dropped;
  {
    std::lock_guard lock(mu_);
    for (auto it = hot_.begin(); it != hot_.end();) {
      if (it->first.first == job && it->second->step == step) {
        dropped.push_back(std::move(it->second));
        it = hot_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (!dropped.empty()) {
    dropped.clear();
    progress_.Notify();
  }
}

std::map<std::string, std::vector<uint64_t>> HotCache::Steps() const {
  std::map<std::string, std::vector<uint64_t>> steps;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, snap] : hot_) steps[key.first].push_back(snap->step);
  }
  for (auto& [job, list] : steps) {
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
  }
  return steps;
}

void HotCache::Clear() {
  std::map<std::pair<std::string, uint32_t>, StagedSnapshotPtr> dropped;
  {
    std::lock_guard lock(mu_);
    dropped.swap(hot_);
  }
}

}  // namespace ckpt::daemon
