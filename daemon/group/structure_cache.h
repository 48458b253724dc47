// The part structures (format/part_structure.h) the coordinator has been sent, by digest,
// so that a node sends its structure once and then only each step's values. Bounded in
// bytes, least recently used dropped first: a node whose structure was dropped hears
// "need structure" and sends it again, so the bound costs a round trip, never a commit.
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "format/part_structure.h"

namespace ckpt::group {

class StructureCache {
 public:
  explicit StructureCache(size_t max_bytes) : max_bytes_(max_bytes) {}

  // Keeps `structure` (or refreshes the copy held under its digest).
  void Add(std::shared_ptr<const format::PartStructure> structure);
  // The structure under `digest`, or null.
  std::shared_ptr<const format::PartStructure> Find(const std::string& digest);

  size_t bytes() const;
  size_t size() const;

 private:
  // What a structure costs in memory: its parsed form holds about twice its text, and each
  // (empty) checksum slot a string of its own.
  static size_t Cost(const format::PartStructure& s) { return 2 * s.json_bytes + 32 * s.checksums + 256; }

  const size_t max_bytes_;
  mutable std::mutex mu_;
  using Lru = std::list<std::shared_ptr<const format::PartStructure>>;
  Lru lru_;  // most recently used first
  std::map<std::string, Lru::iterator> by_digest_;
  size_t bytes_ = 0;
};

}  // namespace ckpt::group
