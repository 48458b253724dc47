// Placements as boxes in the global tensor, and the check that a checkpoint's shards of each
// tensor tile it exactly once (docs/format.md). Used at commit, where a step whose ranks
// disagree about who holds what must not commit, and by the read planner.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/persist/manifest.h"

namespace ckpt::persist {

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

// A region of `whole` that none of `covered` holds; nullopt when there is none, or when the
// boxes are too many to look for one cheaply.
std::optional<Box> FindGap(const Box& whole, const std::vector<Box>& covered);

// OK when the shards of every tensor of `manifest` lie inside its global shape and cover
// it exactly once, ranks holding the very same box counting once (replicas: every
// data-parallel rank holds the whole tensor); otherwise FailedPrecondition naming the
// tensor, and the ranks that overlap or the range nobody holds.
absl::Status CheckTiling(const Manifest& manifest);

}  // namespace ckpt::persist
