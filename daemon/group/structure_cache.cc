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

void StructureCache::ShrinkLocked() {
  // The most recently added whole structure always stays: its node must be able to prepare.
  while (bytes_ > max_bytes_ && whole_.size() > 1) {
    if (!summarize_) {
      const std::string oldest = whole_.back()->digest;  // a copy: erasing frees the original
      EraseLocked(oldest);
      continue;
    }
    std::shared_ptr<const format::PartStructure> oldest = std::move(whole_.back());
    whole_.pop_back();
    bytes_ -= Cost(*oldest);
    summaries_.push_front(format::Summarize(*oldest));
    bytes_ += Cost(*summaries_.front());
    by_digest_[oldest->digest] = {summaries_.begin(), true};
  }
  while (bytes_ > max_bytes_ && !summaries_.empty()) {
    const std::string oldest = summaries_.back()->digest;  // a copy: erasing frees the original
    EraseLocked(oldest);
  }
}

void StructureCache::Add(std::shared_ptr<const format::PartStructure> structure) {
  std::lock_guard lock(mu_);
  if (auto held = by_digest_.find(structure->digest); held != by_digest_.end()) {
    if (!held->second.summary || structure->summary) {
      Lru& list = held->second.summary ? summaries_ : whole_;
      list.splice(list.begin(), list, held->second.at);
      return;
    }
    EraseLocked(structure->digest);  // a whole structure again, for a summary
  }
  Lru& list = structure->summary ? summaries_ : whole_;
  bytes_ += Cost(*structure);
  const bool summary = structure->summary;
  list.push_front(std::move(structure));
  by_digest_[list.front()->digest] = {list.begin(), summary};
  ShrinkLocked();
}

std::shared_ptr<const format::PartStructure> StructureCache::Find(const std::string& digest) {
  std::lock_guard lock(mu_);
  auto held = by_digest_.find(digest);
  if (held == by_digest_.end()) return nullptr;
  Lru& list = held->second.summary ? summaries_ : whole_;
  list.splice(list.begin(), list, held->second.at);
  return *held->second.at;
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
