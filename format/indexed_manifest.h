// Indexed steps (format version 4; docs/format.md, "Indexed manifests"). A step whose whole
// manifest would be larger than a manifest may be (CheckpointStore::kMaxManifestBytes: about
// 290,000 tensor pieces, e.g. 64 nodes x 8 ranks x 600 tensors) is published as one
// node-scoped manifest per node (version 3, each its node's ranks only) and, last, an index
// in manifest.json naming each part by its size and checksum. No file is ever larger than a
// node's share, and a reader that needs the whole step joins the parts.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/manifest.h"

namespace ckpt::format {

// The index of a step, its header taken from `part` (a node-scoped manifest of the step:
// every part of one commit has the same header and scope figures), with no parts yet.
Manifest IndexHeader(const Manifest& part);

// Adds node-scoped `part`, whose text as written is `text`, to `index` (and, in version 5, its
// origin steps to the index's). Parts are added in ascending node order.
void AddToIndex(Manifest& index, const Manifest& part, const std::string& text);
// The same from what is known of the part without it: the node, its ranks, its text's size
// and checksum, and in version 5 its origin steps (a remote publisher's reports).
void AddToIndex(Manifest& index, ManifestNode holds, uint64_t bytes, std::string checksum,
                const std::vector<StepRun>& origin_steps = {});

// Reads the text of a part of the step by its file name (ManifestPartFileName), at most
// `max_bytes` of it.
using PartReader = std::function<absl::StatusOr<std::string>(const std::string& file, size_t max_bytes)>;

// Part `i` of `index` (node `index.nodes[i]`'s), read by `read`: the very one the index
// names (its size and checksum), a node-scoped manifest of the same step and commit (header
// and digest) listing exactly the ranks the index gives its node; DataLoss naming `where`
// and the part otherwise. A reader of one node's ranks needs no other part.
absl::StatusOr<Manifest> ReadIndexedPart(const Manifest& index, size_t i, const PartReader& read,
                                         size_t max_part_bytes, const std::string& where);

// What a reader joins of an indexed step at most, its parts' text in all: 10,000 nodes x 8
// ranks x 200 tensors is 3.7 GB (and about three times that parsed). A step larger still is
// read node by node (a restore in the saved layout), not whole.
inline constexpr uint64_t kMaxJoinedPartsBytes = uint64_t{4} << 30;

// The whole step's manifest from `index` and its parts, read by `read`. Each part must be
// the very one the index names (its size and checksum), a node-scoped manifest of the same
// step and commit (header and digest) listing exactly the ranks the index gives its node;
// DataLoss naming `where` and the part otherwise. The whole step's tiling is the caller's
// to check, as for any whole manifest.
absl::StatusOr<Manifest> JoinIndexedManifest(const Manifest& index, const PartReader& read, size_t max_part_bytes,
                                             const std::string& where);

}  // namespace ckpt::format
