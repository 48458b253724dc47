// Builds the manifest of a step (or, in a group, of this node's ranks of it) from the
// snapshots and the shards written for them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "format/manifest.h"
#include "daemon/persist/shard_writer.h"
#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon::commit {

using DurableShards = std::map<uint32_t, std::pair<StagedSnapshotPtr, persist::WrittenShard>>;

// Fails when two ranks disagree on a tensor's dtype or global shape.
absl::StatusOr<format::Manifest> BuildManifest(const std::string& job, uint64_t step,
                                                uint32_t world_size, const DurableShards& shards);

}  // namespace ckpt::daemon::commit
