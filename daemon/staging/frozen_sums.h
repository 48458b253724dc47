// Chunk checksums of frozen tensors, computed once per generation of their bytes
// (docs/design/incremental.md, section 7). Every snapshot entry of one frozen generation
// holds the same bytes (FrozenTensors hands a generation out only then), so the writer of
// the first such snapshot hashes them and the writers of the later ones look them up:
// a frozen base costs no hashing after the first save. Shared by a session's snapshots;
// writers on several threads use it.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ckpt::daemon {

struct FrozenChecksums {
  std::vector<uint64_t> chunks;  // XXH3-64 of each chunk of `chunk_bytes`
  std::string whole;             // "xxh3:..." of the whole piece
};

class FrozenSums {
 public:
  std::optional<FrozenChecksums> Find(uint64_t generation, uint64_t chunk_bytes) const {
    std::lock_guard lock(mu_);
    auto it = sums_.find({generation, chunk_bytes});
    if (it == sums_.end()) return std::nullopt;
    return it->second;
  }
  void Put(uint64_t generation, uint64_t chunk_bytes, FrozenChecksums sums) {
    std::lock_guard lock(mu_);
    sums_[{generation, chunk_bytes}] = std::move(sums);
  }
  // Forgets every generation but `live` (those the session's tensors have now): a writer of
  // an older snapshot that still wants one hashes its bytes again.
  void Keep(const std::set<uint64_t>& live) {
    std::lock_guard lock(mu_);
    for (auto it = sums_.begin(); it != sums_.end();) {
      it = live.count(it->first.first) != 0 ? std::next(it) : sums_.erase(it);
    }
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, FrozenChecksums> sums_;  // by (generation, chunk bytes)
};

}  // namespace ckpt::daemon
