#include "cuda/chunk_plan.h"

#include <algorithm>
#include <functional>

namespace ckpt::cuda {

std::vector<CopyRegion> CoalesceRegions(std::span<const CopyRegion> regions) {
  // In order of allocation, then of destination: a restore lists tensors by name ("b10"
  // before "b2"), which scatters neighbours apart. Regions of no allocation keep their order
  // (they are never merged); the order of a job's regions never matters to its result.
  std::vector<CopyRegion> sorted(regions.begin(), regions.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](const CopyRegion& a, const CopyRegion& b) {
    if (a.allocation == nullptr || b.allocation == nullptr) return a.allocation == nullptr && b.allocation != nullptr;
    return std::less<>()(a.allocation, b.allocation) ||
           (a.allocation == b.allocation && std::less<>()(a.dst, b.dst));
  });
  std::vector<CopyRegion> out;
  out.reserve(sorted.size());
  for (const CopyRegion& r : sorted) {
    if (r.bytes == 0) continue;
    if (!out.empty()) {
      CopyRegion& last = out.back();
      if (r.allocation != nullptr && r.allocation == last.allocation &&
          static_cast<char*>(last.dst) + last.bytes == r.dst &&
          static_cast<const char*>(last.src) + last.bytes == r.src) {
        last.bytes += r.bytes;
        continue;
      }
    }
    out.push_back(r);
  }
  return out;
}

std::vector<std::vector<CopyRegion>> PlanChunks(std::span<const CopyRegion> regions, int streams,
                                                size_t chunk_bytes) {
  streams = std::max(1, streams);
  chunk_bytes = std::max<size_t>(1, chunk_bytes);
  std::vector<std::vector<CopyRegion>> plan(streams);
  size_t next = 0;
  for (const CopyRegion& r : CoalesceRegions(regions)) {
    for (size_t off = 0; off < r.bytes; off += chunk_bytes) {
      size_t n = std::min(chunk_bytes, r.bytes - off);
      plan[next++ % streams].push_back(
          {static_cast<char*>(r.dst) + off, static_cast<const char*>(r.src) + off, n, r.allocation});
    }
  }
  return plan;
}

}  // namespace ckpt::cuda
