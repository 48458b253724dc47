#include "daemon/group/committed_step.h"

#include <set>
#include <utility>

namespace ckpt::group {

namespace {

// What a node-scoped manifest says of the whole step `whole`, whose text hashes to `digest`.
StepHeader HeaderOf(const format::Manifest& whole, std::string digest) {
  return {whole.world_size,
          static_cast<uint32_t>(whole.nodes.size()),
          whole.total_bytes(),
          static_cast<uint32_t>(whole.tensors.size()),
          std::move(digest),
          whole.run,
          whole.unix_time,
          whole.wall_time,
          whole.metadata};
}

}  // namespace

CommittedStep DescribeCommit(std::string json, const format::Manifest& whole,
                             const std::map<uint32_t, uint64_t>& attempts) {
  CommittedStep c;
  c.header = HeaderOf(whole, format::ManifestDigest(json));
  c.node_of_rank.assign(whole.world_size, ~uint32_t{0});
  for (const format::ManifestNode& node : whole.nodes) {
    NodeShare& share = c.shares[node.node];
    if (auto attempt = attempts.find(node.node); attempt != attempts.end()) share.attempt = attempt->second;
    for (uint32_t rank : node.ranks) {
      if (rank < c.node_of_rank.size()) c.node_of_rank[rank] = node.node;
      ++share.ranks;
      if (const format::ManifestShard* shard = whole.Shard(rank)) share.bytes += shard->bytes;
    }
  }
  c.manifest_json = std::move(json);
  return c;
}

format::Manifest NodeManifest(format::Manifest part, const StepHeader& header, uint32_t node) {
  part.world_size = header.world_size;
  part.run = header.run;
  part.unix_time = header.unix_time;
  part.wall_time = header.wall_time;
  part.metadata = header.metadata;
  part.nodes.clear();
  format::ManifestNode mine{node, {}};
  for (const format::ManifestShard& s : part.shards) mine.ranks.push_back(s.rank);
  part.nodes.push_back(std::move(mine));
  part.scope = format::StepScope{node, header.nodes, header.step_bytes, header.step_tensors, header.digest};
  return part;
}

format::Manifest NodeManifestFromWhole(const format::Manifest& whole, const std::string& digest, uint32_t node) {
  format::Manifest part = whole;
  std::set<uint32_t> mine;
  for (const format::ManifestNode& n : whole.nodes) {
    if (n.node == node) mine.insert(n.ranks.begin(), n.ranks.end());
  }
  std::erase_if(part.shards, [&](const format::ManifestShard& s) { return !mine.count(s.rank); });
  for (auto& [name, tensor] : part.tensors) {
    std::erase_if(tensor.shards, [&](const format::TensorShard& s) { return !mine.count(s.rank); });
  }
  std::erase_if(part.tensors, [](const auto& t) { return t.second.shards.empty(); });
  return NodeManifest(std::move(part), HeaderOf(whole, digest), node);
}

}  // namespace ckpt::group
