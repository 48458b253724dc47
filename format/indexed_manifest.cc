#include "format/indexed_manifest.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/status.h"

namespace ckpt::format {

Manifest IndexHeader(const Manifest& part) {
  Manifest index;
  CopyStepHeader(part, index);
  StepIndex& i = index.index.emplace();
  if (part.increment) {
    // The whole step's figures; origins stay in the parts.
    index.increment = Increment{part.increment->own_bytes, part.increment->referenced_bytes, {}, {}};
  }
  if (part.scope) {
    i.step_bytes = part.scope->step_bytes;
    i.step_tensors = part.scope->step_tensors;
    i.digest = part.scope->digest;
  }
  return index;
}

void AddToIndex(Manifest& index, const Manifest& part, const std::string& text) {
  ManifestNode holds{part.scope ? part.scope->node : 0, {}};
  for (const ManifestShard& s : part.shards) holds.ranks.push_back(s.rank);
  AddToIndex(index, std::move(holds), text.size(), ManifestDigest(text),
             part.increment ? part.increment->origin_steps : std::vector<StepRun>{});
}

void AddToIndex(Manifest& index, ManifestNode holds, uint64_t bytes, std::string checksum,
                const std::vector<StepRun>& origin_steps) {
  if (index.increment) {
    // The index's origin steps are the union of its parts' (what retention reads of it).
    AddIncrement(*index.increment, Increment{0, 0, origin_steps, {}});
  }
  const uint32_t node = holds.node;
  index.nodes.push_back(std::move(holds));
  index.index->parts.push_back({node, ManifestPartFileName(node), bytes, std::move(checksum)});
}

namespace {

// Why `part` (node `node`'s, parsed) is not a part of the step `index` describes; empty when
// it is.
std::string NotAPartOf(const Manifest& index, const Manifest& part, const ManifestNode& node) {
  if (!part.scope) return "it is not a node-scoped manifest";
  if (part.scope->node != node.node) return fmt::format("it is node {}'s part", part.scope->node);
  if (part.job != index.job || part.step != index.step) {
    return fmt::format("it is a part of job {} step {}", part.job, part.step);
  }
  if (part.scope->digest != index.index->digest) {
    return fmt::format("it is a part of another commit of the step (digest {}, the index's {})", part.scope->digest,
                       index.index->digest);
  }
  if (part.world_size != index.world_size || part.run != index.run ||
      part.checksum_chunk_bytes != index.checksum_chunk_bytes) {
    return "its header (world size, run, checksum chunk) differs from the index's";
  }
  std::vector<uint32_t> ranks;
  ranks.reserve(part.shards.size());
  for (const ManifestShard& s : part.shards) ranks.push_back(s.rank);
  if (ranks != node.ranks) {
    return fmt::format("it lists ranks [{}], the index gives node {} ranks [{}]", fmt::join(ranks, ", "), node.node,
                       fmt::join(node.ranks, ", "));
  }
  return {};
}

}  // namespace

absl::StatusOr<Manifest> ReadIndexedPart(const Manifest& index, size_t i, const PartReader& read,
                                         size_t max_part_bytes, const std::string& where) {
  if (!index.index || i >= index.nodes.size()) {
    return absl::InvalidArgumentError(fmt::format("{} is not an index of {} parts", where, i + 1));
  }
  const ManifestNode& node = index.nodes[i];
  const ManifestPart& entry = index.index->parts[i];  // ParseManifest: one per node, in order
  const std::string source = fmt::format("{} (node {}'s part, {})", where, node.node, entry.file);
  auto lost = [&](const std::string& why) { return absl::DataLossError(fmt::format("{}: {}", source, why)); };
  if (entry.bytes > max_part_bytes) {
    return lost(fmt::format("the index gives it {} bytes, more than the {} a manifest may be", entry.bytes,
                            max_part_bytes));
  }
  absl::StatusOr<std::string> text = read(entry.file, max_part_bytes);
  if (absl::IsNotFound(text.status())) return lost("missing");
  if (!text.ok()) return Annotate(text.status(), source);
  if (text->size() != entry.bytes || ManifestDigest(*text) != entry.checksum) {
    return lost(fmt::format("it is not the part the index names ({} bytes, {}; the index: {} bytes, {})",
                            text->size(), ManifestDigest(*text), entry.bytes, entry.checksum));
  }
  CKPT_ASSIGN_OR_RETURN(Manifest part, ParseManifest(*text, source));
  if (std::string why = NotAPartOf(index, part, node); !why.empty()) return lost(why);
  return part;
}

absl::StatusOr<Manifest> JoinIndexedManifest(const Manifest& index, const PartReader& read, size_t max_part_bytes,
                                             const std::string& where) {
  if (!index.index) return absl::InvalidArgumentError(fmt::format("{} is not an index", where));
  uint64_t total = 0;
  for (const ManifestPart& p : index.index->parts) total += std::min<uint64_t>(p.bytes, kMaxJoinedPartsBytes);
  if (total > kMaxJoinedPartsBytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "{}: its {} parts are {} bytes together, more than the {} a reader joins; each node's ranks "
        "still restore in the saved layout from their own node's part",
        where, index.index->parts.size(), total, kMaxJoinedPartsBytes));
  }
  std::vector<std::pair<uint32_t, Manifest>> parts;
  parts.reserve(index.nodes.size());
  for (size_t i = 0; i < index.nodes.size(); ++i) {
    CKPT_ASSIGN_OR_RETURN(Manifest part, ReadIndexedPart(index, i, read, max_part_bytes, where));
    part.scope.reset();
    part.nodes.clear();
    parts.emplace_back(index.nodes[i].node, std::move(part));
  }
  absl::StatusOr<Manifest> whole = MergeManifestParts(parts);
  if (!whole.ok()) return absl::DataLossError(fmt::format("{}: its parts do not join: {}", where, Message(whole.status())));
  // The header is the index's (the parts carry the same; merging takes it from the nodes).
  CopyStepHeader(index, *whole);
  if (index.increment.has_value() != whole->increment.has_value() ||
      (index.increment && index.increment->origin_steps != whole->increment->origin_steps)) {
    return absl::DataLossError(fmt::format("{}: its parts reference other steps than the index says", where));
  }
  if (index.increment) {
    // Each part carries the whole step's figures, as the index does: merging summed them.
    whole->increment->own_bytes = index.increment->own_bytes;
    whole->increment->referenced_bytes = index.increment->referenced_bytes;
  }
  if (whole->StepBytes() != index.index->step_bytes || whole->StepTensors() != index.index->step_tensors) {
    return absl::DataLossError(fmt::format(
        "{}: its parts hold {} bytes in {} tensors, the index says {} bytes in {} tensors", where,
        whole->StepBytes(), whole->StepTensors(), index.index->step_bytes, index.index->step_tensors));
  }
  return whole;
}

}  // namespace ckpt::format
