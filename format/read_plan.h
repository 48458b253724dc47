// The read planner (issue 11): from a step's manifest alone, which bytes of which saved
// shards make up the pieces of tensors a rank wants, in whatever placement it now uses.
// Pure: no I/O, no daemon state, so the same plan serves a restore with the saved
// topology, a restore with another one, verify and export.
//
// A placement is a box in the global tensor: an offset and a local shape per dimension
// (DTensor row, column and block shards; the whole tensor is the box at 0 of the global
// shape). Saved shards are boxes too (TensorShard.offset/shape), stored row-major. The plan
// for a wanted box is, per saved shard it overlaps, the runs of bytes that are contiguous in
// both: one run per overlap when the shards differ only in their first dimension, one per
// row when they split a later one. Flat shards (element ranges of the flattened tensor,
// FSDP style) are matched with boxes and with each other through their runs of flat
// indices (format::Segments).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/manifest.h"
#include "format/tiling.h"

namespace ckpt::format {

// A rank's piece of one tensor, as it now places it.
struct WantedTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;         // local
  std::vector<int64_t> global_shape;  // empty: the local tensor is the whole tensor
  std::vector<int64_t> offset;        // empty: all zeros
  // A flat shard (FSDP style): these element ranges of the flattened global tensor, one
  // after another in a 1-D piece of `shape` [their total]; `offset` is then unused.
  std::vector<format::ElementRange> flat;
  // Of replicas, read this rank's (overrides ReadPlanOptions::prefer_rank for this piece).
  std::optional<uint32_t> from_rank;
};

// `bytes` from byte `source` of a saved entry to byte `destination` of the wanted piece.
struct ByteRun {
  uint64_t source = 0;
  uint64_t destination = 0;
  uint64_t bytes = 0;
  bool operator==(const ByteRun&) const = default;
};

// What one saved shard gives one wanted piece.
struct ShardRead {
  uint32_t rank = 0;
  std::string file;
  // The saved entry in the file's data region; for a piece with `extents`, [0, its bytes).
  uint64_t entry_begin = 0;
  uint64_t entry_end = 0;
  std::string checksum;      // of the whole saved entry
  std::vector<std::string> chunk_checksums;  // of its chunks (TensorShard::chunk_checksums)
  std::vector<ByteRun> runs;  // by source, adjacent ones merged
  // What the file's header must say of the entry: the tensor's dtype and the saved piece's
  // local shape (a reader refuses a header that disagrees before using a byte).
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t chunk_bytes = 0;  // of chunk_checksums: the piece's (version 5) or the manifest's
  // Version 5: where runs of the piece's chunks are, in this step's file and its origins'
  // (empty: the piece is the entry above, whole).
  std::vector<Extent> extents;
};

struct TensorReadPlan {
  std::string name;
  uint64_t bytes = 0;  // of the wanted piece, every one of them covered by `reads`
  std::vector<ShardRead> reads;
  // True when the piece is exactly one saved shard's whole entry (the saved topology).
  bool whole_entry() const {
    return reads.size() == 1 && reads[0].runs.size() == 1 && reads[0].runs[0].source == 0 &&
           reads[0].runs[0].bytes == bytes && reads[0].entry_end - reads[0].entry_begin == bytes;
  }
};

struct ReadPlan {
  std::vector<TensorReadPlan> tensors;  // in the order wanted
  std::vector<std::string> missing;     // allow_missing: wanted, not in the checkpoint
};

struct ReadPlanOptions {
  bool allow_missing = false;  // skip (and list) wanted tensors the checkpoint lacks
  // Of replicas (ranks that saved the very same piece), read this rank's.
  std::optional<uint32_t> prefer_rank;
  // Bounds what one plan may hold (a column shard of a tall tensor is a run per row).
  uint64_t max_runs = uint64_t{1} << 24;
};

// The pieces each rank saved, in their saved placements, by rank then tensor name, each
// read from its own rank (from_rank): what a restore in the saved topology wants, and what
// verify reads of each rank's file. One pass over the manifest.
std::vector<std::vector<WantedTensor>> SavedPieces(const format::Manifest& manifest);

// The plan, or InvalidArgument listing every wanted tensor that cannot be read: not in the
// checkpoint (unless allowed), another dtype or global shape, a box outside the global
// tensor, or a region no saved shard covers (named with its range). DataLoss when the
// manifest's shards of a tensor overlap. From a node-scoped manifest (Manifest::scope),
// pieces other nodes hold are such regions, said to be held elsewhere; and a tensor it
// does not list is never skipped as missing unless it lists all of the step's tensors.
absl::StatusOr<ReadPlan> PlanRead(const format::Manifest& manifest,
                                  const std::vector<WantedTensor>& wanted,
                                  const ReadPlanOptions& options = {});

// The error for tensors that cannot be read from `step`, one problem each ("w: saved as F32,
// wanted as BF16"): the first few and a count of the rest, whatever reads them (the planner,
// or a restore from memory), so that one mismatch is described alike everywhere.
absl::Status CannotRead(const std::vector<std::string>& problems, uint64_t step);
// One tensor's dtype or shape problem in those words, or nothing when they match.
std::optional<std::string> LayoutProblem(const std::string& name, const std::string& saved_dtype,
                                         const std::vector<int64_t>& saved_shape,
                                         const std::string& wanted_dtype,
                                         const std::vector<int64_t>& wanted_shape, const char* shape_kind);

}  // namespace ckpt::format
