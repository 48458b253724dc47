// A committed step as the coordinator announces it. Node 0 publishes the whole step's
// manifest; every other node publishes a manifest of its own ranks (docs/format.md, "Across
// nodes"), for which it needs only the step's header and what the commit gives it: so an
// answer to a node is O(1) bytes however many nodes the step has, not the whole manifest.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "format/manifest.h"
#include "format/part_structure.h"

namespace ckpt::group {

// The whole step, as a node that holds only some of its ranks writes it in its scope.
struct StepHeader {
  uint32_t world_size = 0;
  uint32_t nodes = 0;
  uint64_t step_bytes = 0;
  uint32_t step_tensors = 0;
  std::string digest;  // of the coordinator's decision record (DecisionRecordJson)
  uint64_t run = 0;
  double unix_time = 0;
  std::string wall_time;
  std::map<std::string, std::string> metadata;  // rank 0's user metadata
  // An incremental step (format version 5): the whole step's own and referenced bytes,
  // which each node-scoped manifest records (docs/format.md, "Incremental steps").
  bool incremental = false;
  uint64_t own_bytes = 0;
  uint64_t referenced_bytes = 0;
};

// The ranks, and their shard bytes in all, that a commit gives one node, the node's attempt
// they were prepared in and the run that wrote them (the registration of the newest of the
// node's ranks, Manifest::run): a commit is bound to those bytes, and a node applies it to
// no others (a new run that saves the step number again, an attempt after a delete).
// attempt and run are 0 where not known (a record written by an older ckptd).
struct NodeShare {
  uint32_t ranks = 0;
  uint64_t bytes = 0;
  uint64_t attempt = 0;
  uint64_t run = 0;
  bool operator==(const NodeShare&) const = default;
};

// What a node prepared: a structure the coordinator holds (shared with its StructureCache
// and every round of the same structure) and one step's values.
struct PreparedPart {
  std::shared_ptr<const format::PartStructure> structure;
  format::PartValues values;
  uint64_t attempt = 0;  // the node's attempt it was prepared in (the coordinator's)
  // What the decision reads of the structure and values, copied when the coordinator takes
  // the part (TakeBrief), while the structure is in cache: the decision walks the parts
  // four times, and at 10,000 nodes x 8 ranks x 200 tensors the structures lie apart in
  // gigabytes of heap, where each first touch was a TLB and a cache miss (a fifth of node
  // 0's CPU for a step, by perf). The copies are small and made in arrival order.
  struct Brief {
    std::string digest;
    std::vector<uint32_t> ranks;  // the structure's, by shard
    uint64_t bytes = 0;           // the values' shard bytes, in all
    size_t json_bytes = 0;
    bool summary = false;
  } brief;
  const format::Manifest& shape() const { return structure->structure; }
  // Fills `brief` from `structure` and `values`.
  void TakeBrief();
};
using PreparedParts = std::vector<std::pair<uint32_t, PreparedPart>>;  // by node

struct CommittedStep {
  // The whole step's manifest: on the coordinator while it fits its memory budget, and in
  // answers to node 0 (or to a node that asks for it: one that lost track of its ranks).
  std::string manifest_json;
  StepHeader header;
  std::map<uint32_t, NodeShare> shares;  // by node; a node's own answers carry its own only
  // The coordinator's: the node holding each rank, to tell a retried prepare from a claim
  // on another node's rank. Dropped with the manifest when memory is short.
  std::vector<uint32_t> node_of_rank;
  // The coordinator's, until the whole manifest is assembled from them: what the nodes
  // prepared. Dropped with the manifest when memory is short.
  std::shared_ptr<const PreparedParts> parts;
  // No whole manifest will be sent: it is larger than a step's manifest may be (it stays
  // in the decision log), or it was never recorded (the coordinator stopped between the
  // decision and the assembly). Node 0 then publishes its own ranks like any node.
  bool whole_unavailable = false;
  // Nor will the next steps' be, as far as the coordinator can tell (it would be too
  // large): nodes may withhold their checksums.
  bool checksums_unused = false;
};

// The record the coordinator makes durable before it announces a commit: the header (but
// its digest, which is the digest of this text), and each node's ranks, bytes and part
// structures; O(ranks), however many tensors they hold (docs/format.md, "Decision log").
// `parts` are the step's, sorted by node (a node's structures are listed in their order),
// with their briefs taken.
std::string DecisionRecordJson(const std::string& job, uint64_t step, const CommittedStep& c,
                               const PreparedParts& parts);

// A decision record read back: header (with the text's digest), shares and rank table.
// NotFound when `text` is not a decision record (a whole manifest, as older ckptd recorded).
absl::StatusOr<CommittedStep> ParseDecisionRecord(const std::string& text);

// About how large the whole step's manifest of these parts would be (its structures' text,
// from their briefs): a little less, never far more.
size_t WholeManifestEstimate(const PreparedParts& parts);
// The whole step's manifest from what its nodes prepared.
absl::StatusOr<format::Manifest> AssembleWhole(const PreparedParts& parts);

// The header and shares of `whole`, whose text is `json` (kept), each node's share with
// its attempt from `attempts` when given.
CommittedStep DescribeCommit(std::string json, const format::Manifest& whole,
                             const std::map<uint32_t, uint64_t>& attempts = {});

// The manifest a node other than node 0 publishes: its `part` (the manifest of its own
// durable ranks, as it prepared them) with the whole step's header and scope.
format::Manifest NodeManifest(format::Manifest part, const StepHeader& header, uint32_t node);

// The same, cut from the whole step's manifest (a node that no longer holds its snapshots:
// a step it kept in doubt across a restart).
format::Manifest NodeManifestFromWhole(const format::Manifest& whole, const std::string& digest, uint32_t node);

}  // namespace ckpt::group
