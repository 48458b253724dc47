// Where a node sends its heartbeats, prepares and outcome polls: to its parent in a tree
// of fan-out F laid out like a heap (node n's parent is (n - 1) / F), so that the
// coordinator hears F batched calls per step instead of one per node. 10,000 nodes at F = 32 are 3 levels
// below node 0; groups of at most F + 1 nodes are one level, with no relays at all.
//
// The layout is computed, never negotiated: a node relays for whoever calls it, and a node
// whose parent does not answer calls the coordinator directly (GrpcGroupClient).
#pragma once

#include <cstdint>
#include <optional>

namespace ckpt::group {

// Node n's parent, or nullopt for node 0 and without a tree (fan-out 0).
inline std::optional<uint32_t> RelayParent(uint32_t node, uint32_t fanout) {
  if (node == 0 || fanout == 0) return std::nullopt;
  return (node - 1) / fanout;
}

// Whether `node` is below `ancestor` in the tree (not `ancestor` itself).
inline bool RelayBelow(uint32_t node, uint32_t ancestor, uint32_t fanout) {
  if (fanout == 0 || node <= ancestor) return false;
  while (node > ancestor) node = (node - 1) / fanout;
  return node == ancestor;
}

// Levels below node 0 that `nodes` fill (1 without relays).
inline uint32_t RelayDepth(uint32_t nodes, uint32_t fanout) {
  if (nodes <= 1) return 0;
  if (fanout == 0) return 1;
  uint32_t depth = 0;
  for (uint32_t n = nodes - 1; n > 0; n = (n - 1) / fanout) ++depth;
  return depth;
}

}  // namespace ckpt::group
