// Where a node that lost its own copy of a step (a replacement machine, a root deleted)
// finds its ranks' shards: rebuilt from the fragments its coding group holds in memory
// (--replication; daemon/replicate/peer_shards.h). The restorer's one view of peer replicas.
// Only steps whose fragments were sent for the restoring trainer's own uid are offered: a
// job name alone does not make another user's weights theirs.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

// A shard rebuilt from peers: its data region, kept alive by `data`.
struct ShardBytes {
  std::shared_ptr<const char> data;
  uint64_t size = 0;
};

class PeerSource {
 public:
  // Memory for a rebuilt shard of `bytes` (null: none); kept alive by what it returns.
  using Allocate = std::function<std::shared_ptr<char>(size_t bytes)>;

  virtual ~PeerSource() = default;
  // (run, step) of the committed steps of `job`, saved by `uid`, whose shard of `rank` (a
  // rank this node held) the live peers can rebuild, ascending.
  virtual std::vector<std::pair<uint64_t, uint64_t>> Steps(const std::string& job, uint32_t rank, uid_t uid) = 0;
  // This node's manifest of the step as the peers hold it: JSON, to be parsed as untrusted.
  virtual absl::StatusOr<std::string> Manifest(const std::string& job, uint64_t step, uid_t uid) = 0;
  // The rank's shard (its data region, at most `max_bytes`), rebuilt from any k fragments
  // that pass their checksums, into memory from `allocate` (empty: the heap). DataLoss when
  // fewer than k can be had.
  virtual absl::StatusOr<ShardBytes> Shard(const std::string& job, uint64_t step, uint32_t rank, uid_t uid,
                                           uint64_t max_bytes, const Allocate& allocate = {}) = 0;
};

}  // namespace ckpt::daemon
