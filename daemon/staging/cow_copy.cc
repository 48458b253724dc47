#include "daemon/staging/cow_copy.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <thread>

#include "common/fault_guard.h"

namespace ckpt::daemon {

CowCopy::CowCopy(WriteProtector& protector, std::vector<Region> regions, uint64_t chunk_bytes)
    : protector_(protector) {
  std::map<uint64_t, Chunk> chunks;
  for (const Region& r : regions) {
    if (r.bytes == 0) continue;
    const uint64_t end = r.trainer_begin + r.bytes;
    auto range = std::find_if(protector.ranges().begin(), protector.ranges().end(),
                              [&](const WriteProtector::Range& g) {
                                return r.trainer_begin >= g.begin && end <= g.begin + g.bytes;
                              });
    if (range == protector.ranges().end()) {
      outside_ = true;
      continue;
    }
    // Chunks are cut from the start of the arena, so that they hold whole pages.
    const uint64_t range_end = range->begin + range->bytes;
    for (uint64_t at = range->begin + (r.trainer_begin - range->begin) / chunk_bytes * chunk_bytes;
         at < end; at += chunk_bytes) {
      Chunk& c = chunks[at];
      c.begin = at;
      c.bytes = std::min(chunk_bytes, range_end - at);
      uint64_t lo = std::max(at, r.trainer_begin), hi = std::min(at + c.bytes, end);
      c.parts.push_back({r.source + (lo - r.trainer_begin), r.destination + (lo - r.trainer_begin),
                         hi - lo});
    }
  }
  for (auto& [begin, chunk] : chunks) chunks_.push_back(std::move(chunk));
  state_ = std::make_unique<std::atomic<uint8_t>[]>(chunks_.size());
  for (size_t i = 0; i < chunks_.size(); ++i) state_[i] = 0;
}

absl::Status CowCopy::Protect() {
  if (outside_) {
    return absl::InternalError("a tensor lies outside the trainer's write-protectable arenas");
  }
  // Adjacent chunks go in one call: a protection change flushes the trainer's TLB.
  for (size_t i = 0; i < chunks_.size();) {
    size_t j = i + 1;
    while (j < chunks_.size() && chunks_[j].begin == chunks_[j - 1].begin + chunks_[j - 1].bytes) ++j;
    const uint64_t end = chunks_[j - 1].begin + chunks_[j - 1].bytes;
    if (absl::Status done = protector_.Protect(chunks_[i].begin, end - chunks_[i].begin); !done.ok()) {
      for (size_t k = 0; k < j; ++k) (void)protector_.Release(chunks_[k].begin, chunks_[k].bytes);
      return done;
    }
    i = j;
  }
  remaining_ = chunks_.size();
  return absl::OkStatus();
}

size_t CowCopy::ChunkAt(uint64_t address) const {
  auto it = std::upper_bound(chunks_.begin(), chunks_.end(), address,
                             [](uint64_t a, const Chunk& c) { return a < c.begin; });
  if (it == chunks_.begin()) return chunks_.size();
  --it;
  return address < it->begin + it->bytes ? static_cast<size_t>(it - chunks_.begin()) : chunks_.size();
}

bool CowCopy::Take(size_t i) {
  uint8_t expected = 0;
  if (!state_[i].compare_exchange_strong(expected, 1)) return false;
  for (const Part& p : chunks_[i].parts) {
    // The trainer can punch holes into its arena: a fault fails this copy, not ckptd.
    if (!GuardedMemcpy(p.destination, p.source, p.bytes)) failed_ = true;
  }
  // A trainer that is gone cannot be released, nor does it need to be.
  (void)protector_.Release(chunks_[i].begin, chunks_[i].bytes);
  state_[i].store(2);
  state_[i].notify_all();
  remaining_.fetch_sub(1);
  return true;
}

void CowCopy::ServeFaults() {
  while (!stop_.load()) {
    std::optional<uint64_t> address = protector_.NextFault(std::chrono::milliseconds(5));
    if (!address) continue;
    size_t i = ChunkAt(*address);
    if (i == chunks_.size()) {
      protector_.Wake(*address & ~uint64_t{4095}, 4096);  // not ours: nothing to wait for
      continue;
    }
    next_ = i + 1;  // the trainer writes on from here: copy ahead of it
    if (Take(i)) {
      faulted_.fetch_add(1);
    } else if (state_[i].load() == 2) {
      protector_.Wake(chunks_[i].begin, chunks_[i].bytes);  // released before we read it
    }
  }
}

absl::Status CowCopy::Run() {
  std::thread faults([this] { ServeFaults(); });
  const size_t n = chunks_.size();
  while (remaining_.load() > 0) {
    size_t start = next_.load();
    size_t found = n;
    for (size_t k = 0; k < n && found == n; ++k) {
      size_t i = (start + k) % n;
      if (state_[i].load() == 0) found = i;
    }
    if (found == n) {
      // The rest is being copied for faults: wait for it.
      for (size_t i = 0; i < n; ++i) state_[i].wait(1);
      break;
    }
    next_ = found + 1;
    Take(found);
  }
  stop_ = true;
  faults.join();
  if (failed_) {
    return absl::DataLossError(
        "the trainer's shared memory went away under the copy (pages were removed from an arena)");
  }
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
