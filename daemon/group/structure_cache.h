// The part structures (format/part_structure.h) the coordinator has been sent, by digest,
// so that a node sends its structure once and then only each step's values. Bounded in
// bytes: the least recently used are kept as summaries first (enough for their values to be
// checked every step; not for a new combination's tiling check or a whole manifest), then
// dropped. A node whose structure was dropped hears "need structure" and sends it again,
// so the bound costs a round trip, never a commit.
#pragma once

#include <cstddef>
#include <list>
#include <unordered_map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "format/part_structure.h"

namespace ckpt::group {

class StructureCache {
 public:
  // Without `summarize`, structures over the bound are dropped whole (a coordinator that
  // publishes every step's whole manifest on a shared root needs every structure whole).
  explicit StructureCache(size_t max_bytes, bool summarize = true) : max_bytes_(max_bytes), summarize_(summarize) {}

  // Keeps `structure` (or refreshes the copy held under its digest; a whole structure
  // replaces a summary).
  void Add(std::shared_ptr<const format::PartStructure> structure);
  // The structure under `digest`, whole or summarized, or null.
  std::shared_ptr<const format::PartStructure> Find(const std::string& digest);
  // The same for many digests under one lock (null for an empty one): node 0 looks up a
  // relay's batch of hundreds at once.
  std::vector<std::shared_ptr<const format::PartStructure>> FindMany(const std::vector<const std::string*>& digests);
  // Drops what is held under `digest`: its node sends the whole part again.
  void Forget(const std::string& digest);

  size_t bytes() const;
  size_t size() const;       // structures held, whole or summarized
  size_t summaries() const;  // of them, summarized

 private:
  // What a structure costs in memory: its packed tensors and shards; a summary, its ranks.
  static size_t Cost(const format::PartStructure& s) {
    return s.summary ? 256 + 96 * s.structure.shards.size() : s.bytes();
  }
  using Lru = std::list<std::shared_ptr<const format::PartStructure>>;
  // Over the bound: the least recently used whole structures become summaries (a few bytes
  // per rank: a 10,000-node job keeps every node's), and only then are summaries dropped.
  void ShrinkLocked();
  // The least recently used of `list` but `keep` (approximately: a list in order of
  // insertion, with a second chance for what was found since), left in place at its back.
  std::shared_ptr<const format::PartStructure> TakeLeastRecentLocked(Lru& list, const format::PartStructure* keep);
  void EraseLocked(const std::string& digest);
  // Find, with mu_ held.
  std::shared_ptr<const format::PartStructure> FindLocked(const std::string& digest);

  const size_t max_bytes_;
  const bool summarize_;
  mutable std::mutex mu_;
  Lru whole_;      // most recently added or given a second chance first
  Lru summaries_;  // the same
  struct Held {
    Lru::iterator at;
    bool summary;
    bool found;  // by Find or Add since ShrinkLocked last passed it over
  };
  std::unordered_map<std::string, Held> by_digest_;  // hashed: 10,000 lookups a step at node 0
  size_t bytes_ = 0;
};

}  // namespace ckpt::group
