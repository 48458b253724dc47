#include "daemon/group/committed_step.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <utility>

#include "format/json_text.h"

namespace ckpt::group {

using json = nlohmann::json;

namespace {

// What a node-scoped manifest says of the whole step `whole`, whose text hashes to `digest`.
StepHeader HeaderOf(const format::Manifest& whole, std::string digest) {
  StepHeader h{whole.world_size,
               static_cast<uint32_t>(whole.nodes.size()),
               whole.total_bytes(),
               static_cast<uint32_t>(whole.tensors.size()),
               std::move(digest),
               whole.run,
               whole.unix_time,
               whole.wall_time,
               whole.metadata};
  if (whole.increment) {
    h.incremental = true;
    h.own_bytes = whole.increment->own_bytes;
    h.referenced_bytes = whole.increment->referenced_bytes;
  }
  return h;
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

void PreparedPart::TakeBrief() {
  brief.digest = structure->digest;
  brief.ranks = structure->ranks;
  brief.bytes = 0;
  for (const format::PartValues::Rank& rank : values.ranks) brief.bytes += rank.bytes;
  brief.json_bytes = structure->json_bytes;
  brief.summary = structure->summary;
}

std::string DecisionRecordJson(const std::string& job, uint64_t step, const CommittedStep& c,
                               const PreparedParts& parts) {
  // Each node's ranks, in order, by a counting sort over the rank table: a map of vectors
  // cost node 0 milliseconds a step at 80,000 ranks.
  const uint32_t nodes_end = c.shares.empty() ? 0 : c.shares.rbegin()->first + 1;
  std::vector<uint32_t> first(static_cast<size_t>(nodes_end) + 1, 0);  // by node: where its ranks begin
  for (uint32_t node : c.node_of_rank) {
    if (node < nodes_end) ++first[node + 1];
  }
  for (size_t n = 1; n < first.size(); ++n) first[n] += first[n - 1];
  std::vector<uint32_t> ranks(first.back());
  {
    std::vector<uint32_t> next(first.begin(), first.end() - 1);
    for (uint32_t rank = 0; rank < c.node_of_rank.size(); ++rank) {
      if (uint32_t node = c.node_of_rank[rank]; node < nodes_end) ranks[next[node]++] = rank;
    }
  }
  // Written straight to text, as nlohmann would dump it (keys in order): at 10,000 nodes
  // a tree of 80,000 ranks cost node 0 tens of ms inside every decision.
  const StepHeader& h = c.header;
  format::JsonText w;
  w.BeginObject();
  w.Field("format", "ckptd-decision");
  w.Field("format_version", 1);
  w.Field("job", job);
  w.Field("metadata", h.metadata);
  w.Key("nodes");
  w.BeginArray();
  auto part = parts.begin();  // both by node: walked together
  for (const auto& [node, share] : c.shares) {
    w.BeginObject();
    w.Field("attempt", share.attempt);
    w.Field("bytes", share.bytes);
    w.Field("node", node);
    w.Key("ranks");
    w.BeginArray();
    for (uint32_t i = first[node]; i < first[node + 1]; ++i) w.Number(ranks[i]);
    w.EndArray();
    w.Field("run", share.run);
    w.Key("structures");
    w.BeginArray();
    while (part != parts.end() && part->first < node) ++part;
    for (; part != parts.end() && part->first == node; ++part) w.String(part->second.brief.digest);
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.Field("outcome", "committed");
  if (h.incremental) w.Field("own_bytes", h.own_bytes);
  if (h.incremental) w.Field("referenced_bytes", h.referenced_bytes);
  w.Field("run", h.run);
  w.Field("step", step);
  w.Field("step_bytes", h.step_bytes);
  w.Field("step_tensors", h.step_tensors);
  w.Field("unix_time", h.unix_time);
  w.Field("wall_time", h.wall_time);
  w.Field("world_size", h.world_size);
  w.EndObject();
  return w.Take();
}

namespace {

struct BadRecord : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A field that must be an unsigned integer of at most `max`: nlohmann's get<> would cast a
// float such as 1e300, or wrap a negative number, into a valid-looking value.
uint64_t Unsigned(const json& j, const char* field, uint64_t max) {
  const json& v = j.at(field);
  if (!v.is_number_unsigned() || v.get<uint64_t>() > max) {
    throw BadRecord(fmt::format("\"{}\" is not an integer in 0..{}", field, max));
  }
  return v.get<uint64_t>();
}

}  // namespace

absl::StatusOr<CommittedStep> ParseDecisionRecord(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("format") || j["format"] != "ckptd-decision") {
    return absl::NotFoundError("not a decision record");
  }
  try {
    if (j.at("format_version") != 1) {
      return absl::FailedPreconditionError(
          fmt::format("decision record format_version {} is not 1", j.at("format_version").dump()));
    }
    constexpr uint64_t kU32 = UINT32_MAX;
    CommittedStep c;
    StepHeader& h = c.header;
    h.world_size = static_cast<uint32_t>(Unsigned(j, "world_size", format::kMaxManifestWorldSize));
    if (h.world_size == 0) throw BadRecord("world size 0");
    h.step_bytes = Unsigned(j, "step_bytes", UINT64_MAX);
    h.step_tensors = static_cast<uint32_t>(Unsigned(j, "step_tensors", kU32));
    h.run = Unsigned(j, "run", UINT64_MAX);
    if (!j.at("unix_time").is_number()) throw BadRecord("\"unix_time\" is not a number");
    h.unix_time = j.at("unix_time").get<double>();
    h.wall_time = j.at("wall_time").get<std::string>();
    h.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    h.digest = format::ManifestDigest(text);
    // An incremental step's (absent from other records).
    if (j.contains("own_bytes")) {
      h.incremental = true;
      h.own_bytes = Unsigned(j, "own_bytes", UINT64_MAX);
      h.referenced_bytes = Unsigned(j, "referenced_bytes", UINT64_MAX);
    }
    c.node_of_rank.assign(h.world_size, ~uint32_t{0});
    for (const json& n : j.at("nodes")) {
      const uint32_t node = static_cast<uint32_t>(Unsigned(n, "node", kU32 - 1));
      NodeShare& share = c.shares[node];
      share.bytes = Unsigned(n, "bytes", UINT64_MAX);
      // What binds the commit to the bytes each node wrote (absent from older records).
      if (n.contains("attempt")) share.attempt = Unsigned(n, "attempt", UINT64_MAX);
      if (n.contains("run")) share.run = Unsigned(n, "run", UINT64_MAX);
      for (const json& r : n.at("ranks")) {
        if (!r.is_number_unsigned() || r.get<uint64_t>() >= h.world_size ||
            c.node_of_rank[r.get<uint64_t>()] != ~uint32_t{0}) {
          throw BadRecord(fmt::format("rank {} is outside the world or listed twice", r.dump()));
        }
        c.node_of_rank[r.get<uint64_t>()] = node;
        ++share.ranks;
      }
    }
    h.nodes = static_cast<uint32_t>(c.shares.size());
    return c;
  } catch (const std::exception& e) {  // BadRecord, or nlohmann's type and key errors
    return absl::DataLossError(fmt::format("decision record: {}", e.what()));
  }
}

size_t WholeManifestEstimate(const PreparedParts& parts) {
  size_t bytes = 0;
  for (const auto& [node, part] : parts) bytes += part.brief.json_bytes;
  return bytes;
}

absl::StatusOr<format::Manifest> AssembleWhole(const PreparedParts& parts) {
  std::vector<std::pair<uint32_t, format::Manifest>> joined;
  joined.reserve(parts.size());
  for (const auto& [node, part] : parts) {
    absl::StatusOr<format::Manifest> m = format::JoinPart(*part.structure, part.values);
    if (!m.ok()) return m.status();
    joined.emplace_back(node, std::move(*m));
  }
  return format::MergeManifestParts(joined);
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
  if (part.increment && header.incremental) {
    // The whole step's figures, as in every kind of manifest; the origins stay this node's.
    part.increment->own_bytes = header.own_bytes;
    part.increment->referenced_bytes = header.referenced_bytes;
  }
  return part;
}

format::Manifest NodeManifestFromWhole(const format::Manifest& whole, const std::string& digest, uint32_t node) {
  format::Manifest part = whole;
  std::set<uint32_t> mine;
  for (const format::ManifestNode& n : whole.nodes) {
    if (n.node == node) mine.insert(n.ranks.begin(), n.ranks.end());
  }
  format::RemoveRanks(part, [&](uint32_t rank) { return !mine.count(rank); });
  return NodeManifest(std::move(part), HeaderOf(whole, digest), node);
}

}  // namespace ckpt::group
