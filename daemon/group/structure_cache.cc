#include "daemon/group/structure_cache.h"

namespace ckpt::group {

void StructureCache::EraseLocked(const std::string& digest) {
  auto held = by_digest_.find(digest);
  if (held == by_digest_.end()) return;
  Lru& list = held->second.summary ? summaries_ : whole_;
  bytes_ -= Cost(**held->second.at);
  list.erase(held->second.at);
  by_digest_.erase(held);
}

std::shared_ptr<const format::PartStructure> StructureCache::TakeLeastRecentLocked(
    Lru& list, const format::PartStructure* keep) {
  // Second chance: a structure found since it was last passed over goes back to the front
  // (Find only marks it: a splice per lookup cost node 0 milliseconds a step in cache
  // misses). Each pass clears the marks it meets, so with two or more in the list this
  // ends within two laps.
  while (true) {
    std::shared_ptr<const format::PartStructure> oldest = list.back();
    Held& held = by_digest_.at(oldest->digest);
    if (!held.found && oldest.get() != keep) return oldest;
    held.found = false;
    list.splice(list.begin(), list, held.at);
  }
}

void StructureCache::ShrinkLocked() {
  // The most recently added whole structure always stays: its node must be able to prepare.
  const format::PartStructure* newest = whole_.empty() ? nullptr : whole_.front().get();
  while (bytes_ > max_bytes_ && whole_.size() > 1) {
    std::shared_ptr<const format::PartStructure> oldest = TakeLeastRecentLocked(whole_, newest);
    if (!summarize_) {
      EraseLocked(oldest->digest);
      continue;
    }
    whole_.pop_back();
    bytes_ -= Cost(*oldest);
    summaries_.push_front(format::Summarize(*oldest));
    bytes_ += Cost(*summaries_.front());
    by_digest_[oldest->digest] = {summaries_.begin(), true, false};
  }
  while (bytes_ > max_bytes_ && !summaries_.empty()) {
    EraseLocked(TakeLeastRecentLocked(summaries_, nullptr)->digest);
  }
}

void StructureCache::Add(std::shared_ptr<const format::PartStructure> structure) {
  std::lock_guard lock(mu_);
  if (auto held = by_digest_.find(structure->digest); held != by_digest_.end()) {
    if (!held->second.summary || structure->summary) {
      held->second.found = true;
      return;
    }
    EraseLocked(structure->digest);  // a whole structure again, for a summary
  }
  Lru& list = structure->summary ? summaries_ : whole_;
  bytes_ += Cost(*structure);
  const bool summary = structure->summary;
  list.push_front(std::move(structure));
  by_digest_[list.front()->digest] = {list.begin(), summary, false};
  ShrinkLocked();
}

std::shared_ptr<const format::PartStructure> StructureCache::FindLocked(const std::string& digest) {
  auto held = by_digest_.find(digest);
  if (held == by_digest_.end()) return nullptr;
  held->second.found = true;
  return *held->second.at;
}

std::shared_ptr<const format::PartStructure> StructureCache::Find(const std::string& digest) {
  std::lock_guard lock(mu_);
  return FindLocked(digest);
}

std::vector<std::shared_ptr<const format::PartStructure>> StructureCache::FindMany(
    const std::vector<const std::string*>& digests) {
  std::vector<std::shared_ptr<const format::PartStructure>> found(digests.size());
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < digests.size(); ++i) {
    if (!digests[i]->empty()) found[i] = FindLocked(*digests[i]);
  }
  return found;
}

void StructureCache::Forget(const std::string& digest) {
  std::lock_guard lock(mu_);
  EraseLocked(digest);
}

size_t StructureCache::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

size_t StructureCache::size() const {
  std::lock_guard lock(mu_);
  return whole_.size() + summaries_.size();
}

size_t StructureCache::summaries() const {
  std::lock_guard lock(mu_);
  return summaries_.size();
}

}  // namespace ckpt::group
