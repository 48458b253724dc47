#include "daemon/staging/snapshot_layout.h"

namespace ckpt::daemon {

SnapshotLayout LayOut(const std::vector<format::TensorEntry>& entries, const std::vector<EntryPlace>& places,
                      uint64_t alignment, uint64_t min_run) {
  SnapshotLayout out;
  out.offset.resize(entries.size());
  for (size_t i = 0; i < entries.size();) {
    // The run of entries from i bound for the same place.
    size_t end = i + 1;
    while (end < entries.size() && places[end] == places[i]) ++end;
    const EntryPlace place = places[i];
    if (place != EntryPlace::kShared) {
      uint64_t& cursor = place == EntryPlace::kOwn ? out.own_bytes : out.frozen_bytes;
      const uint64_t begin = entries[i].begin;
      if (entries[end - 1].end - begin >= min_run) {
        cursor += (begin % alignment + alignment - cursor % alignment) % alignment;
      }
      for (size_t j = i; j < end; ++j) {
        out.offset[j] = cursor + (entries[j].begin - begin);
      }
      cursor += entries[end - 1].end - begin;
    }
    i = end;
  }
  return out;
}

}  // namespace ckpt::daemon
