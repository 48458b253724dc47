#include "daemon/group/structure_cache.h"

namespace ckpt::group {

void StructureCache::Add(std::shared_ptr<const format::PartStructure> structure) {
  std::lock_guard lock(mu_);
  if (auto held = by_digest_.find(structure->digest); held != by_digest_.end()) {
    lru_.splice(lru_.begin(), lru_, held->second);
    return;
  }
  bytes_ += Cost(*structure);
  lru_.push_front(std::move(structure));
  by_digest_[lru_.front()->digest] = lru_.begin();
  // The newest always stays, however large: a node must be able to prepare it.
  while (bytes_ > max_bytes_ && lru_.size() > 1) {
    bytes_ -= Cost(*lru_.back());
    by_digest_.erase(lru_.back()->digest);
    lru_.pop_back();
  }
}

std::shared_ptr<const format::PartStructure> StructureCache::Find(const std::string& digest) {
  std::lock_guard lock(mu_);
  auto held = by_digest_.find(digest);
  if (held == by_digest_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, held->second);
  return *held->second;
}

size_t StructureCache::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

size_t StructureCache::size() const {
  std::lock_guard lock(mu_);
  return lru_.size();
}

}  // namespace ckpt::group
