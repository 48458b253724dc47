// Where each entry of a snapshot's data region is staged: the snapshot's own block (tensors
// that change, the train state), a new frozen block (frozen tensors copied from the trainer,
// for later snapshots to share), or a frozen block an earlier snapshot staged (shared, not
// copied). Pure.
//
// Each run of entries bound for one block starts there at an offset congruent to its place
// in the data region, modulo the O_DIRECT block: a shard file's data region starts aligned,
// so the writer sends every whole block of a run straight from staging memory, as it does a
// snapshot held in one piece; only the blocks where runs meet go through its bounce buffer.
// Runs shorter than `min_run` are packed (a bounce copy of them is nothing), so alternating
// small adapters and frozen weights cost no padding.
#pragma once

#include <cstdint>
#include <vector>

#include "format/safetensors.h"

namespace ckpt::daemon {

enum class EntryPlace { kOwn, kFrozen, kShared };

struct SnapshotLayout {
  std::vector<uint64_t> offset;  // per entry, in its block (unused for kShared)
  uint64_t own_bytes = 0;        // the own block's size
  uint64_t frozen_bytes = 0;     // the new frozen block's size
};

SnapshotLayout LayOut(const std::vector<format::TensorEntry>& entries, const std::vector<EntryPlace>& places,
                      uint64_t alignment = 4096, uint64_t min_run = uint64_t{64} << 10);

}  // namespace ckpt::daemon
