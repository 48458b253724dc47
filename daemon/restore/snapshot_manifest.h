// The manifest a step is sealed with at its peers (--replication): what the fragments the
// holders keep describe. The replicator codes each rank's staged snapshot (its logical layout
// in staging memory, every tensor whole), and a node lost for good rebuilds that snapshot and
// reads each piece at its manifest's byte range (RebuiltSnapshot). Without increments the
// committed manifest says exactly that (a rank's file's data region is its staged snapshot).
// An incremental step's does not (format version 5: pieces referenced in earlier steps have
// extents and no byte range, train state may be referenced, and own pieces' ranges are in
// the step's own file), so the sealed manifest is this one instead.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "daemon/staging/staged_snapshot.h"
#include "format/manifest.h"

namespace ckpt::daemon {

// `committed`, this node's manifest of a step as committed (whole or node-scoped, any
// version), with every piece and train-state blob of its ranks where `snapshots` (the staged
// snapshots of those ranks, one each) hold them: each piece a byte range of its rank's
// snapshot, no extents, no referenced train state, no origins, each shard's `bytes` its
// snapshot's. Checksums, whole and per chunk, are kept as committed: they are of the logical
// bytes, which the snapshot holds. A manifest without `increment` is returned as it is.
//
// The result stays format version 5 (an `increment` naming no origin, own bytes only): its
// pieces keep their own `chunk_bytes` and chunk checksums, which versions 1-4 can only record
// at the step-wide `checksum_chunk_bytes` (an increment's chunks are --increment-chunk-bytes,
// 1 KiB for sparse tables), and its shards keep their tagged file names, which versions 1-4
// refuse; a version 5 piece with a byte range and no extents is a piece written whole, which
// ParseManifest accepts and RebuiltSnapshot reads as it reads versions 1-4.
//
// FailedPrecondition naming the rank or entry when `committed` lists a rank with no snapshot,
// or a piece or blob its snapshot lacks or holds at another size.
absl::StatusOr<format::Manifest> SnapshotManifest(const format::Manifest& committed,
                                                  const std::vector<StagedSnapshotPtr>& snapshots);

}  // namespace ckpt::daemon
