// Placements as boxes in the global tensor, and the check that a checkpoint's shards of each
// tensor tile it exactly once (docs/format.md). Used at commit, where a step whose ranks
// disagree about who holds what must not commit, and by the read planner.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "format/manifest.h"

namespace ckpt::format {

// [lo, lo + extent) per dimension.
struct Box {
  std::vector<int64_t> lo, extent;
  uint64_t Volume() const;
  std::string Range() const;  // "[0:3, 0:10]"
  // Whether the box has as many dimensions as `shape` and lies within it.
  bool Inside(const std::vector<int64_t>& shape) const;
  bool operator==(const Box&) const = default;
};

// The box a placement describes in a tensor of shape `global`: `offset` (empty: zeros) and
// local `shape` (empty: the whole tensor).
Box PlacementBox(const std::vector<int64_t>& offset, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& global);

std::optional<Box> Intersect(const Box& a, const Box& b);

// Where a piece sits in the global tensor: a box, or flat element ranges (TensorShard).
struct Placement {
  Box box;                         // when `flat` is empty
  std::vector<ElementRange> flat;  // ascending, disjoint; the piece holds them in order
  bool is_flat() const { return !flat.empty(); }
  uint64_t Volume() const;
  std::string Describe() const;  // "[0:3, 0:10]" or "elements [0, 30) [60, 90)"
  // Equal for equal placements: replicas are found by it in a hash map, not pairwise.
  std::string Key() const;
  bool operator==(const Placement&) const = default;
};

// The placement of a piece of local `shape` at `offset` (a box; empty: zeros), or holding
// the `flat` ranges, in a tensor of shape `global`.
Placement PlacementOf(const std::vector<int64_t>& offset, const std::vector<int64_t>& shape,
                      const std::vector<ElementRange>& flat, const std::vector<int64_t>& global);
Placement ShardPlacement(const TensorShard& shard, const std::vector<int64_t>& global);

// Elements contiguous both in the global tensor (row-major) and in the piece: `length`
// elements from flat index `global` of the tensor and element `local` of the piece.
struct Segment {
  uint64_t global = 0;
  uint64_t local = 0;
  uint64_t length = 0;
};

// A placement's segments, by `global` (and so by `local`): one per flat range; for a box, one
// per run over the trailing dimensions it spans whole (one for row shards, one per row for
// column shards). ResourceExhausted when there would be more than `max`.
absl::StatusOr<std::vector<Segment>> Segments(const Placement& placement,
                                              const std::vector<int64_t>& global, uint64_t max);

// The first range [begin, end) of flat indices that `wanted` (by `global`) holds and no
// interval of `covered` ([begin, end) pairs, any order) does; nullopt when all are covered.
std::optional<ElementRange> FirstUncovered(const std::vector<Segment>& wanted,
                                           std::vector<ElementRange> covered);

// A region of `whole` that none of `covered` holds; nullopt when there is none, or when the
// boxes are too many to look for one cheaply.
std::optional<Box> FindGap(const Box& whole, const std::vector<Box>& covered);

// OK when the shards of every tensor of `manifest` lie inside its global shape and cover
// it exactly once, ranks holding the very same box counting once (replicas: every
// data-parallel rank holds the whole tensor); otherwise FailedPrecondition naming the
// tensor, and the ranks that overlap or the range nobody holds.
absl::Status CheckTiling(const Manifest& manifest);
// The same for one tensor, its pieces gathered from wherever they are held.
absl::Status CheckTensorTiling(const std::string& name, const ManifestTensor& tensor);

}  // namespace ckpt::format
