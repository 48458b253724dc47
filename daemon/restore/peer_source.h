// Where a node that lost its own copy of a step (a replacement machine, a root deleted)
// finds its ranks' shards: rebuilt from the fragments its coding group holds in memory
// (--replication; daemon/replicate/peer_shards.h). The restorer's one view of peer replicas.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

class PeerSource {
 public:
  virtual ~PeerSource() = default;
  // (run, step) of the committed steps of `job` whose shard of `rank` (a rank this node
  // held) the live peers can rebuild, ascending.
  virtual std::vector<std::pair<uint64_t, uint64_t>> Steps(const std::string& job, uint32_t rank) = 0;
  // This node's manifest of the step as the peers hold it: JSON, to be parsed as untrusted.
  virtual absl::StatusOr<std::string> Manifest(const std::string& job, uint64_t step) = 0;
  // The rank's shard (its data region), rebuilt from any k fragments that pass their
  // checksums. DataLoss when fewer than k can be had.
  virtual absl::StatusOr<std::string> Shard(const std::string& job, uint64_t step, uint32_t rank) = 0;
};

}  // namespace ckpt::daemon
