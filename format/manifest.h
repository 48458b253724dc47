// manifest.json: the record that makes a step directory a checkpoint (docs/format.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/increment.h"

namespace ckpt::format {

// Which readers can read a manifest. Each is written only where it must be, so that older
// readers still read the manifests they can; a reader refuses versions it does not know.
//   1: box shards only, every rank of the step listed.
//   2: some shard is a flat shard ("flat" instead of "offset").
//   3: node-scoped: only the ranks one node holds, and a `scope` (StepScope) saying what the
//      whole step holds. A reader of version 2 would take it for a step it can read whole.
//   4: an index (StepIndex): the whole step's header and `nodes`, its shards and tensors in
//      one node-scoped manifest per node beside it (a step too large for one manifest).
//   5: an incremental step (format/increment.h: Increment, extents, tagged file names), of
//      any kind: whole, node-scoped (with `scope`) or an index (with `index`).
inline constexpr int kManifestBoxFormatVersion = 1;
inline constexpr int kManifestFlatFormatVersion = 2;
inline constexpr int kManifestScopedFormatVersion = 3;
inline constexpr int kManifestIndexFormatVersion = 4;
// The newest version this ckptd reads.
inline constexpr int kManifestFormatVersion = kManifestIncrementFormatVersion;
// Entries longer than this also get a checksum per chunk of this many bytes (the last one
// shorter), so that a read of part of an entry (a resharding restore) is verified without
// reading the whole entry. Recorded in each manifest (Manifest::checksum_chunk_bytes).
inline constexpr uint64_t kChecksumChunkBytes = uint64_t{8} << 20;
// How many chunks an entry of `bytes` has; 0 when it is not chunked (one chunk or less).
inline uint64_t ChecksumChunks(uint64_t bytes, uint64_t chunk_bytes) {
  return chunk_bytes == 0 || bytes <= chunk_bytes ? 0 : (bytes + chunk_bytes - 1) / chunk_bytes;
}

// Flattened (row-major) element indices [begin, end) of a global tensor.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool operator==(const ElementRange&) const = default;
};

// Where one rank's piece of a tensor lives and where it goes in the global tensor: a box
// (`offset` and local `shape`: DTensor row, column and block shards), or, for FSDP-style
// flat shards, element ranges of the flattened tensor (`flat`, ascending and disjoint),
// stored one after another in a 1-D entry of `shape` [their total].
struct TensorShard {
  uint32_t rank = 0;
  // Where the piece is written whole: its rank's file and the byte range within the file's
  // data region. A version 5 piece with `extents` has neither (file empty, begin = end = 0).
  std::string file;
  uint64_t begin = 0;
  uint64_t end = 0;
  std::vector<int64_t> offset;  // placement: start index per dimension in the global tensor
  std::vector<int64_t> shape;   // placement: local shape
  std::string checksum;         // of the whole entry
  // Of each Manifest::checksum_chunk_bytes of the entry, when it is longer than one chunk
  // (empty otherwise, and in manifests written before chunks were recorded).
  std::vector<std::string> chunk_checksums;
  std::vector<ElementRange> flat;  // placement of a flat shard; `offset` is then empty
  // Version 5: the piece's own chunk size (its chunk_checksums' and its extents'), and, for
  // a piece not written whole in this step's file, where each run of its chunks is.
  uint64_t chunk_bytes = 0;
  std::vector<Extent> extents;
};

struct ManifestTensor {
  std::string dtype;
  std::vector<int64_t> global_shape;
  std::vector<TensorShard> shards;
};

struct TrainStateEntry {
  uint64_t begin = 0;  // in the rank's own file, or in its origin file of `step`
  uint64_t end = 0;
  std::string checksum;
  std::optional<uint64_t> step;  // version 5: a blob equal to an earlier step's, referenced
};

struct ManifestShard {
  uint32_t rank = 0;
  std::string file;
  uint64_t bytes = 0;
  std::map<std::string, std::string> metadata;  // this rank's snapshot metadata
  std::map<std::string, TrainStateEntry> train_state;  // stored as U8 entries in the file
};

// Which ranks' shards a node holds (group commit; docs/format.md).
struct ManifestNode {
  uint32_t node = 0;
  std::vector<uint32_t> ranks;
  bool operator==(const ManifestNode&) const = default;
};

// What the whole step holds, in a manifest that lists only some of its ranks: a node's own
// ranks on node-local disks in a group (docs/format.md, "Node-scoped manifests").
struct StepScope {
  uint32_t node = 0;          // the node whose ranks this manifest lists
  uint32_t nodes = 0;         // nodes that hold ranks of the step
  uint64_t step_bytes = 0;    // shard bytes of the whole step, every node's
  uint32_t step_tensors = 0;  // tensors of the whole step
  std::string digest;         // "xxh3:<16 hex>" of the whole step's manifest.json text
};

// One node's part of an indexed step: a node-scoped manifest (version 3) in the step
// directory, named ManifestPartFileName(node), exactly `bytes` long, with this checksum of its
// text (so that the index binds the very parts it was written with).
struct ManifestPart {
  uint32_t node = 0;
  std::string file;
  uint64_t bytes = 0;
  std::string checksum;  // "xxh3:<16 hex>" of the part's text
};

// A step whose manifest is published as an index and one part per node (format version 4;
// docs/format.md, "Indexed manifests"): where the whole step's manifest would be larger than
// a manifest may be.
struct StepIndex {
  uint64_t step_bytes = 0;    // shard bytes of the whole step
  uint32_t step_tensors = 0;  // tensors of the whole step
  std::string digest;         // the parts' StepScope::digest, every one the same
  std::vector<ManifestPart> parts;  // one per entry of Manifest::nodes, in its order
};

struct Manifest {
  int format_version = kManifestFormatVersion;  // as parsed; ManifestToJson writes what the contents need
  std::string job;
  uint64_t step = 0;
  double unix_time = 0;
  std::string wall_time;  // ISO 8601, UTC
  uint32_t world_size = 0;
  std::string ckptd_version;
  // Which run of the job saved the step: when its newest rank registered (wall clock, ns;
  // 0 in manifests from before it was recorded). A job that goes back to an older step and
  // trains on saves its new steps under a later run, so ordering steps by (run, step)
  // puts them after the abandoned higher-numbered ones.
  uint64_t run = 0;
  uint64_t checksum_chunk_bytes = 0;  // of TensorShard::chunk_checksums; 0: none recorded
  std::map<std::string, std::string> metadata;  // rank 0's user metadata
  std::map<std::string, ManifestTensor> tensors;
  // By rank: ranks 0..world_size-1 in a whole manifest, an ascending subset of them in a
  // scoped one (see `scope`). Look a rank up with Shard(), never by index.
  std::vector<ManifestShard> shards;
  std::vector<ManifestNode> nodes;     // where each rank's shard was written; by node
  // Set when this manifest lists only the ranks of one node (format version 3): `tensors`,
  // `shards` and `nodes` are then that node's alone, and the whole step's figures are here.
  std::optional<StepScope> scope;
  // Set in an index (format version 4): `tensors` and `shards` are then empty, `nodes` lists
  // every rank, and each node's part is a manifest of its own (JoinIndexedManifest).
  std::optional<StepIndex> index;
  // Set in every version 5 manifest (an incremental step, format/increment.h).
  std::optional<Increment> increment;

  // Shard bytes of the ranks this manifest lists (the whole step's unless scoped).
  uint64_t total_bytes() const;
  // The rank's shard entry, or nullptr when this manifest does not list it (outside the
  // world, or held by another node in a scoped manifest).
  const ManifestShard* Shard(uint32_t rank) const;
  // Shard bytes and tensors of the whole step, whichever node's manifest this is.
  uint64_t StepBytes() const;
  uint32_t StepTensors() const;
  // The node holding `rank`'s shard; nullopt when the manifest does not say (single node).
  std::optional<uint32_t> NodeOf(uint32_t rank) const;
};

// Written as format version 5 when `increment` is set, else 4 when `index` is set, 3 when
// `scope` is; otherwise 2 when some shard is flat, else 1.
std::string ManifestToJson(const Manifest& manifest);

// "xxh3:<16 hex>" of a manifest's JSON text as written: what StepScope::digest records of the
// whole step's manifest, so that a node-scoped manifest names the one it was cut from.
std::string ManifestDigest(const std::string& manifest_json);

// What a reader loads of one manifest at most (whole, node-scoped, an index or a part): no
// larger is written, so that nothing is committed that no reader could load.
inline constexpr size_t kMaxManifestBytes = size_t{64} << 20;

// The largest world a manifest may describe (the group's own limit, 1M ranks).
inline constexpr uint32_t kMaxManifestWorldSize = 1u << 20;

// The largest step a step directory's name can hold ("step-" and at most 19 digits).
inline constexpr uint64_t kMaxStep = 9'999'999'999'999'999'999ull;

// "rank-00003.safetensors": the one name a rank's shard file may have up to version 4
// (version 5: TaggedShardFileName).
std::string ShardFileName(uint32_t rank);
// "manifest-node-00003.json": the one name node 3's part of an indexed step may have.
std::string ManifestPartFileName(uint32_t node);

enum class ManifestScope {
  // A committed step: shards are exactly ranks 0..world_size-1, or, in a node-scoped
  // manifest (version 3, with `scope`), a non-empty ascending subset of them.
  kWhole,
  kPart,   // one node's ranks before a group commit: any ascending subset
};

// Parses and checks a manifest: version, required fields, the job name, shard ranks and
// file names (each rank's file is ShardFileName(rank), so no manifest can point outside
// its step directory or at another rank's file), every tensor piece inside a listed
// rank's file with a placement of the tensor's rank. A node-scoped manifest's scope is
// checked against what it lists (StepScope; docs/format.md).
absl::StatusOr<Manifest> ParseManifest(const std::string& json, const std::string& source,
                                       ManifestScope scope = ManifestScope::kWhole);

// Joins the parts that nodes prepared into the manifest of the whole step: shards and
// tensor pieces of every rank, `nodes` listing who holds what. Fails, naming the problem,
// when parts disagree (job, step, world size, a tensor's dtype or global shape), a rank
// appears twice or is missing.
absl::StatusOr<Manifest> MergeManifestParts(const std::vector<std::pair<uint32_t, Manifest>>& parts);

// What merging parts checks first (MergeManifestParts, and format::CheckStructuresTile,
// which checks without merging): they agree on job, step and world size, and every rank of the
// world is in exactly one of them. FailedPrecondition naming the first disagreement.
absl::Status CheckPartsCoverWorld(const std::vector<std::pair<uint32_t, const Manifest*>>& parts);
// That tensor `name` of `node`'s part has the dtype and global shape of `other`'s.
absl::Status CheckSameTensor(const std::string& name, uint32_t node, const ManifestTensor& t,
                             const ManifestTensor& other);

// Sets `to`'s step header (job, step, times, world size, version, run, checksum chunk size,
// metadata) to `from`'s, leaving what it lists alone.
void CopyStepHeader(const Manifest& from, Manifest& to);

// Adds the shards and tensor pieces of `more` (other ranks of the same step) to `manifest`,
// keeping both in rank order: the parts one node prepared at different times, as one.
void AppendRanks(Manifest& manifest, Manifest more);

// Removes the shards and tensor pieces of every rank `remove` names, and the tensors left
// without pieces: a node's ranks cut from a whole manifest, or ranks said again cut from
// an older part. `nodes` and `scope` are left as they are.
void RemoveRanks(Manifest& manifest, const std::function<bool(uint32_t rank)>& remove);

// Whether `shard`'s placement fits a tensor of shape `global`: a box inside it, or flat
// ranges that are ascending, disjoint, inside it and as many elements as the 1-D local
// shape. InvalidArgument completing "tensor T: rank R's piece ..." otherwise.
absl::Status CheckPlacement(const TensorShard& shard, const std::vector<int64_t>& global);

// The key under which a train-state blob is stored in a shard file.
std::string TrainStateKey(const std::string& name);

}  // namespace ckpt::format
