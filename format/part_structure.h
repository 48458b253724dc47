// A node's manifest part, split into what stays the same from step to step (its structure:
// tensor names, dtypes, shapes, placements, files and byte ranges) and what each step
// changes (checksums, shard sizes, metadata, times). A group agrees on a structure once, by
// its digest, and then sends only the values each step (docs/architecture.md, "The group
// at scale"): a node with 8 ranks of 200 tensors prepares ~40 KiB a step instead of ~390.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/manifest.h"

namespace ckpt::format {

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
  // Only a summary (Summarize): `structure` has no tensors. Enough to check a step's
  // values and describe its ranks, not to check tiling or to join a part again.
  bool summary = false;
  Manifest structure;
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

}  // namespace ckpt::format
