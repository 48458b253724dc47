// A rank's shard rebuilt from its peers' fragments, as the snapshot that hot restore reads:
// its entries where this node's manifest of the step puts them, every tensor and train-state
// blob checked against the manifest's checksum before anything is served from it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/restore/peer_source.h"
#include "daemon/staging/staged_snapshot.h"
#include "format/manifest.h"

namespace ckpt::daemon {

// DataLoss naming the entry when a byte differs from what the manifest says was saved;
// FailedPrecondition when the manifest does not describe the rank's shard as one region (a
// piece or blob referenced in another step's file: an incremental step is sealed with
// SnapshotManifest's manifest, never its own).
absl::StatusOr<StagedSnapshotPtr> RebuiltSnapshot(const format::Manifest& manifest, uint32_t rank, ShardBytes data);

}  // namespace ckpt::daemon
