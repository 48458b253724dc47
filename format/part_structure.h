// A node's manifest part, split into what stays the same from step to step (its structure:
// tensor names, dtypes, shapes, placements, files and byte ranges) and what each step
// changes (checksums, shard sizes, metadata, times; in format version 5 also where each
// piece's bytes are, and the increment). A group agrees on a structure once, by
// its digest, and then sends only the values each step (docs/architecture.md, "The group
// at scale"): a node with 8 ranks of 200 tensors prepares ~40 KiB a step instead of ~390.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/manifest.h"

namespace ckpt::format {

// A part's tensor pieces without their checksums, packed into a few arrays: about 60 bytes
// a piece, where the parsed manifest took about 310 (a coordinator's first step at 10,000
// nodes x 8 ranks x 200 tensors held 5 GiB of them). Unpacked again only to join a part
// (JoinPart) or to check one tensor's tiling at a time (CheckStructuresTile).
struct PackedTensors {
  struct Tensor {
    std::string name;
    std::string dtype;
    uint32_t global_at = 0;  // the global shape: coords[global_at, global_at + dims)
    uint32_t dims = 0;
    uint32_t first = 0;      // its pieces: pieces[first, first + count), in the part's order
    uint32_t count = 0;
  };
  struct Piece {
    uint64_t begin = 0;
    uint64_t end = 0;
    uint32_t holder = 0;     // the piece's rank and file: holders[holder]
    uint32_t at = 0;         // coords[at...]: offset, then shape, then flat (begin, end) pairs
    uint32_t chunks = 0;     // chunk checksums the piece has
    uint32_t flat = 0;       // flat ranges
    uint32_t offset_dims = 0;
    uint32_t shape_dims = 0;
    uint64_t chunk_bytes = 0;  // version 5: the piece's own chunk size
  };
  struct Holder {
    uint32_t rank = 0;
    std::string file;
  };
  std::vector<Tensor> tensors;  // by name, as Manifest::tensors
  std::vector<Piece> pieces;
  std::vector<int64_t> coords;
  std::vector<Holder> holders;  // a few: one per rank of the part

  // What it takes in memory, roughly.
  size_t bytes() const;
  // Tensor `i` as the manifest had it, its checksums empty (placeholders for each chunk).
  ManifestTensor Unpack(size_t i) const;
};

// A part with every per-step field cleared, and the digest of its JSON text: equal digests,
// equal structures (XXH3-64 of the canonical text; a group's structures are few).
struct PartStructure {
  // First what a coordinator reads of 10,000 structures every step (in its first two cache
  // lines; the parsed manifest after them is kilobytes to megabytes away).
  std::string digest;       // "xxh3:<16 hex>"
  size_t json_bytes = 0;    // of the structure's text: what caching it costs, roughly
  size_t checksums = 0;     // how many PartValues::checksums a part of this structure has
  // By shard: the least a rank's file may hold (the end of its last entry), so that values
  // can never describe a file shorter than its own entries.
  std::vector<uint64_t> min_bytes;
  // By shard: its rank. The same as structure.shards' ranks, side by side: a coordinator
  // checks and places 10,000 nodes' ranks a step, a cache line per part instead of one per
  // shard.
  std::vector<uint32_t> ranks;
  // Of format version 5 (an incremental part): where each piece's and train-state entry's
  // bytes are is a value (PartValues::places), as are the part's increment and its shards'
  // byte ranges, and these count the places a part of this structure has.
  bool incremental = false;
  size_t located_pieces = 0;
  size_t located_blobs = 0;  // train-state entries
  // Only a summary (Summarize): no tensors, packed or not. Enough to check a step's values
  // and describe its ranks, not to check tiling or to join a part again.
  bool summary = false;
  // Everything but the tensors, which are in `tensors`.
  Manifest structure;
  PackedTensors tensors;

  // What it takes in memory, roughly: what a cache of structures counts.
  size_t bytes() const;
};

// What one step of a part says beyond its structure.
struct PartValues {
  uint64_t step = 0;
  uint64_t run = 0;
  double unix_time = 0;
  std::string wall_time;
  std::map<std::string, std::string> metadata;  // the part's (its lowest rank's)
  struct Rank {
    uint64_t bytes = 0;
    std::map<std::string, std::string> metadata;
  };
  std::vector<Rank> ranks;  // in the structure's shard order
  // Every checksum of the part, in the structure's order: per tensor (by name), per piece,
  // the entry's checksum and then its chunk checksums; then per rank, per train-state entry.
  // Checksums as ckptd writes them ("xxh3:" and 16 lowercase hex digits) are kept as their
  // 64-bit value in `xxh3`: a prepare carries 8 bytes a piece and a coordinator allocates
  // nothing per piece. Any other text (a part not written by ckptd) goes in `checksums`,
  // and `xxh3` is then empty.
  std::vector<uint64_t> xxh3;
  std::vector<std::string> checksums;
  // Or neither, and only how many there are: the checksums stayed on the node, because the
  // coordinator keeps none of this job's (its whole manifest is not assembled). At 10,000
  // nodes x 8 ranks x 200 tensors they were 128 MB a step that node 0 parsed to discard.
  size_t withheld = 0;
  size_t checksum_count() const { return withheld ? withheld : xxh3.empty() ? checksums.size() : xxh3.size(); }
  // Version 5 (an incremental part): where its bytes are this step, which changes every step
  // (docs/design/incremental.md, section 10). Packed in the structure's order: per tensor (by
  // name), per piece, a count n of extents, then for n = 0 the piece's byte range in its
  // rank's own file (begin, end), else n extents as (chunk begin, chunk end, the origin's
  // step + 1 or 0 for the rank's own file, at); then per rank, per train-state entry,
  // (begin, end, the origin's step + 1 or 0). Left out with withheld checksums: nothing is
  // assembled from them.
  std::vector<uint64_t> places;
  // Version 5: the part's increment (its ranks' own and referenced bytes, origin steps and
  // origins); set exactly when the structure is incremental.
  std::optional<Increment> increment;
  // The same values with only the count of their checksums.
  PartValues WithChecksumsWithheld() const;
};

struct SplitResult {
  std::shared_ptr<const PartStructure> structure;
  PartValues values;
};

// Splits a part; its structure's digest is computed here, never taken on trust.
SplitResult SplitPart(const Manifest& part);

// The part again. InvalidArgument, naming the difference, when `values` does not fit
// `structure` (another number of ranks or checksums).
absl::StatusOr<Manifest> JoinPart(const PartStructure& structure, const PartValues& values);

// The same structure without its tensors (a few bytes per rank), for a coordinator that
// has checked the structure's combination and keeps tens of thousands of them.
std::shared_ptr<const PartStructure> Summarize(const PartStructure& structure);

// Whether `values` fits `structure`, in O(ranks): what a coordinator checks per step.
absl::Status CheckValuesFit(const PartStructure& structure, const PartValues& values);

// What MergeManifestParts and CheckTiling together say of the parts these structures (each
// node's, whole) are of, without building the merged manifest: they agree on job and world
// size, every rank is in exactly one part, each tensor has one dtype and global shape, and
// its pieces tile it. One tensor is unpacked at a time, so that checking a 10,000-node step
// costs a tensor's worth of memory. The number of tensors when OK; FailedPrecondition when a
// structure is only a summary.
absl::StatusOr<uint32_t> CheckStructuresTile(const std::vector<std::pair<uint32_t, const PartStructure*>>& parts);

}  // namespace ckpt::format
