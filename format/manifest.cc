#include "format/manifest.h"

#include <fmt/format.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/names.h"
#include "format/checksum.h"
#include "format/json_fields.h"
#include "format/json_text.h"

namespace ckpt::format {

using nlohmann::json;

std::string ShardFileName(uint32_t rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

std::string ManifestPartFileName(uint32_t node) { return fmt::format("manifest-node-{:05d}.json", node); }

uint64_t Manifest::total_bytes() const {
  uint64_t total = 0;
  for (const ManifestShard& s : shards) total += s.bytes;
  return total;
}

const ManifestShard* Manifest::Shard(uint32_t rank) const {
  // A whole manifest lists ranks 0..world_size-1 in order: the rank is its index.
  if (rank < shards.size() && shards[rank].rank == rank) return &shards[rank];
  // A node-scoped one lists an ascending subset of them.
  auto it = std::lower_bound(shards.begin(), shards.end(), rank,
                             [](const ManifestShard& s, uint32_t r) { return s.rank < r; });
  return it != shards.end() && it->rank == rank ? &*it : nullptr;
}

uint64_t Manifest::StepBytes() const {
  return scope ? scope->step_bytes : index ? index->step_bytes : total_bytes();
}

uint32_t Manifest::StepTensors() const {
  return scope ? scope->step_tensors : index ? index->step_tensors : static_cast<uint32_t>(tensors.size());
}

std::string ManifestDigest(const std::string& manifest_json) {
  return ChecksumOf(manifest_json.data(), manifest_json.size());
}

std::optional<uint32_t> Manifest::NodeOf(uint32_t rank) const {
  for (const ManifestNode& n : nodes) {
    if (std::find(n.ranks.begin(), n.ranks.end(), rank) != n.ranks.end()) return n.node;
  }
  return std::nullopt;
}

std::string TrainStateKey(const std::string& name) { return "__train_state__." + name; }

void CopyStepHeader(const Manifest& from, Manifest& to) {
  to.job = from.job;
  to.step = from.step;
  to.unix_time = from.unix_time;
  to.wall_time = from.wall_time;
  to.world_size = from.world_size;
  to.ckptd_version = from.ckptd_version;
  to.run = from.run;
  to.checksum_chunk_bytes = from.checksum_chunk_bytes;
  to.metadata = from.metadata;
}

void AppendRanks(Manifest& manifest, Manifest more) {
  auto by_rank = [](const auto& a, const auto& b) { return a.rank < b.rank; };
  if (more.increment) {
    if (!manifest.increment) manifest.increment.emplace();
    AddIncrement(*manifest.increment, *more.increment);
  }
  for (ManifestShard& s : more.shards) manifest.shards.push_back(std::move(s));
  std::sort(manifest.shards.begin(), manifest.shards.end(), by_rank);
  for (auto& [name, t] : more.tensors) {
    auto [it, first] = manifest.tensors.try_emplace(name, ManifestTensor{t.dtype, t.global_shape, {}});
    for (TensorShard& s : t.shards) it->second.shards.push_back(std::move(s));
    std::sort(it->second.shards.begin(), it->second.shards.end(), by_rank);
  }
}

void RemoveRanks(Manifest& manifest, const std::function<bool(uint32_t rank)>& remove) {
  std::erase_if(manifest.shards, [&](const ManifestShard& s) { return remove(s.rank); });
  if (manifest.increment) RemoveOrigins(*manifest.increment, remove);
  for (auto& [name, tensor] : manifest.tensors) {
    std::erase_if(tensor.shards, [&](const TensorShard& s) { return remove(s.rank); });
  }
  std::erase_if(manifest.tensors, [](const auto& t) { return t.second.shards.empty(); });
}

namespace {

int FormatVersionOf(const Manifest& m) {
  if (m.increment) return kManifestIncrementFormatVersion;
  if (m.index) return kManifestIndexFormatVersion;
  if (m.scope) return kManifestScopedFormatVersion;
  for (const auto& [name, t] : m.tensors) {
    for (const TensorShard& s : t.shards) {
      if (!s.flat.empty()) return kManifestFlatFormatVersion;
    }
  }
  return kManifestBoxFormatVersion;
}

}  // namespace

absl::Status CheckPlacement(const TensorShard& shard, const std::vector<int64_t>& global) {
  if (!shard.flat.empty()) {
    int64_t numel = 1;
    for (int64_t d : global) {
      if (d < 0 || (d > 0 && numel > std::numeric_limits<int64_t>::max() / d)) {
        return absl::InvalidArgumentError(fmt::format("has an impossible global shape [{}]", fmt::join(global, ", ")));
      }
      numel *= d;
    }
    int64_t total = 0, after = 0;
    for (const ElementRange& r : shard.flat) {
      if (r.begin < after || r.end <= r.begin || r.end > numel) {
        return absl::InvalidArgumentError(fmt::format(
            "has flat element range [{}, {}), which is empty, out of order, overlaps the one "
            "before or lies outside the {} elements of the tensor",
            r.begin, r.end, numel));
      }
      after = r.end;
      total += r.end - r.begin;
    }
    if (shard.shape.size() != 1 || shard.shape[0] != total) {
      return absl::InvalidArgumentError(fmt::format(
          "has flat element ranges holding {} elements but local shape [{}]; a flat shard is "
          "1-D, its ranges one after another",
          total, fmt::join(shard.shape, ", ")));
    }
    return absl::OkStatus();
  }
  if (shard.offset.size() != global.size() || shard.shape.size() != global.size()) {
    return absl::InvalidArgumentError("has a placement with a different rank than the global shape");
  }
  for (size_t d = 0; d < global.size(); ++d) {
    if (global[d] < 0 || shard.offset[d] < 0 || shard.shape[d] < 0 || shard.offset[d] > global[d] - shard.shape[d]) {
      return absl::InvalidArgumentError(fmt::format(
          "lies outside the global shape in dimension {} (offset {}, size {}, global size {})", d,
          shard.offset[d], shard.shape[d], global[d]));
    }
  }
  return absl::OkStatus();
}

namespace {

constexpr char kChecksumKey[] = "manifest_checksum";

// The manifest's own checksum: XXH3 of its JSON text (as ckptd writes it) with the checksum
// field empty. A manifest edited by hand, or damaged, no longer matches.
std::string Digest(json j) {
  j[kChecksumKey] = "";
  std::string text = j.dump(1);
  return ChecksumOf(text.data(), text.size());
}

}  // namespace

std::string ManifestToJson(const Manifest& m) {
  // Written straight to text (format/json_text.h), keys in nlohmann's order: building the
  // JSON tree first cost node 0 seconds per step for a 10,000-node step's manifest.
  JsonText w(/*indent=*/1);
  w.BeginObject();
  if (m.checksum_chunk_bytes != 0) w.Field("checksum_chunk_bytes", m.checksum_chunk_bytes);
  w.Field("ckptd_version", m.ckptd_version);
  w.Field("format", "ckptd-manifest");
  w.Field("format_version", FormatVersionOf(m));
  if (m.increment) {
    w.Key("increment");
    WriteIncrement(w, *m.increment);
  }
  if (m.index) {
    w.Key("index");
    w.BeginObject();
    w.Field("digest", m.index->digest);
    w.Key("parts");
    w.BeginArray();
    for (const ManifestPart& p : m.index->parts) {
      w.BeginObject();
      w.Field("bytes", p.bytes);
      w.Field("checksum", p.checksum);
      w.Field("file", p.file);
      w.Field("node", p.node);
      w.EndObject();
    }
    w.EndArray();
    w.Field("step_bytes", m.index->step_bytes);
    w.Field("step_tensors", m.index->step_tensors);
    w.EndObject();
  }
  w.Field("job", m.job);
  // The checksum is of the text with this field empty (Digest): filled in at the end.
  w.Key(kChecksumKey);
  const size_t checksum_at = w.text().size() + 1;  // inside the quotes
  w.String("");
  w.Field("metadata", m.metadata);
  if (!m.nodes.empty()) {
    w.Key("nodes");
    w.BeginArray();
    for (const ManifestNode& n : m.nodes) {
      w.BeginObject();
      w.Field("node", n.node);
      w.Field("ranks", n.ranks);
      w.EndObject();
    }
    w.EndArray();
  }
  w.Field("run", m.run);
  if (m.scope) {
    w.Key("scope");
    w.BeginObject();
    w.Field("digest", m.scope->digest);
    w.Field("node", m.scope->node);
    w.Field("nodes", m.scope->nodes);
    w.Field("step_bytes", m.scope->step_bytes);
    w.Field("step_tensors", m.scope->step_tensors);
    w.EndObject();
  }
  w.Key("shards");
  w.BeginArray();
  for (const ManifestShard& s : m.shards) {
    w.BeginObject();
    w.Field("bytes", s.bytes);
    w.Field("file", s.file);
    w.Field("metadata", s.metadata);
    w.Field("rank", s.rank);
    w.Key("train_state");
    w.BeginObject();
    for (const auto& [name, e] : s.train_state) {
      w.Key(name);
      w.BeginObject();
      w.Field("checksum", e.checksum);
      w.Key("data_offsets");
      w.Pair(e.begin, e.end);
      if (e.step) w.Field("step", *e.step);
      w.EndObject();
    }
    w.EndObject();
    w.EndObject();
  }
  w.EndArray();
  w.Field("step", m.step);
  w.Key("tensors");
  w.BeginObject();
  for (const auto& [name, t] : m.tensors) {
    w.Key(name);
    w.BeginObject();
    w.Field("dtype", t.dtype);
    w.Field("global_shape", t.global_shape);
    w.Key("shards");
    w.BeginArray();
    for (const TensorShard& s : t.shards) {
      w.BeginObject();
      w.Field("checksum", s.checksum);
      if (s.chunk_bytes != 0) w.Field("chunk_bytes", s.chunk_bytes);
      if (!s.chunk_checksums.empty()) w.Field("chunk_checksums", s.chunk_checksums);
      if (s.extents.empty()) {
        w.Key("data_offsets");
        w.Pair(s.begin, s.end);
      } else {
        w.Key("extents");
        WriteExtents(w, s.extents);
      }
      if (s.extents.empty()) w.Field("file", s.file);
      if (s.flat.empty()) {
        w.Field("offset", s.offset);
      } else {
        w.Key("flat");
        w.BeginArray();
        for (const ElementRange& r : s.flat) w.Pair(r.begin, r.end);
        w.EndArray();
      }
      w.Field("rank", s.rank);
      w.Field("shape", s.shape);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndObject();
  w.Field("unix_time", m.unix_time);
  w.Field("wall_time", m.wall_time);
  w.Field("world_size", m.world_size);
  w.EndObject();
  std::string text = w.Take();
  text.insert(checksum_at, ChecksumOf(text.data(), text.size()));
  return text;
}

namespace {

using json_fields::BadField;
using json_fields::Int;
using json_fields::Ints;
using json_fields::IsDigest;
using json_fields::Real;

// The "scope" object's fields, each required and of its type.
StepScope ParseStepScope(const json& j) {
  if (!j.is_object()) throw BadField("\"scope\" is not an object");
  auto field = [&](const char* name) -> const json& {
    auto it = j.find(name);
    if (it == j.end()) throw BadField(fmt::format("\"scope\" has no \"{}\"", name));
    return *it;
  };
  StepScope scope;
  scope.node = Int<uint32_t>(field("node"), "scope.node");
  scope.nodes = Int<uint32_t>(field("nodes"), "scope.nodes");
  scope.step_bytes = Int<uint64_t>(field("step_bytes"), "scope.step_bytes");
  scope.step_tensors = Int<uint32_t>(field("step_tensors"), "scope.step_tensors");
  if (!field("digest").is_string()) throw BadField("\"scope.digest\" is not a string");
  scope.digest = field("digest").get<std::string>();
  return scope;
}

// The "index" object (format version 4), each field required and of its type.
StepIndex ParseStepIndex(const json& j) {
  if (!j.is_object()) throw BadField("\"index\" is not an object");
  auto field = [&](const json& o, const char* where, const char* name) -> const json& {
    auto it = o.find(name);
    if (it == o.end()) throw BadField(fmt::format("\"{}\" has no \"{}\"", where, name));
    return *it;
  };
  StepIndex index;
  index.step_bytes = Int<uint64_t>(field(j, "index", "step_bytes"), "index.step_bytes");
  index.step_tensors = Int<uint32_t>(field(j, "index", "step_tensors"), "index.step_tensors");
  if (!field(j, "index", "digest").is_string()) throw BadField("\"index.digest\" is not a string");
  index.digest = j.at("digest").get<std::string>();
  const json& parts = field(j, "index", "parts");
  if (!parts.is_array()) throw BadField("\"index.parts\" is not an array");
  for (const json& p : parts) {
    if (!p.is_object()) throw BadField("an entry of \"index.parts\" is not an object");
    ManifestPart part;
    part.node = Int<uint32_t>(field(p, "index.parts", "node"), "index.parts.node");
    part.bytes = Int<uint64_t>(field(p, "index.parts", "bytes"), "index.parts.bytes");
    if (!field(p, "index.parts", "file").is_string() || !field(p, "index.parts", "checksum").is_string()) {
      throw BadField("\"file\" or \"checksum\" of an entry of \"index.parts\" is not a string");
    }
    part.file = p.at("file").get<std::string>();
    part.checksum = p.at("checksum").get<std::string>();
    index.parts.push_back(std::move(part));
  }
  return index;
}

// What an index lists against itself: every rank of the world on exactly one node, and one
// part per node, named for it. Empty when it holds together, else why not.
std::string IndexProblem(const Manifest& m) {
  const StepIndex& index = *m.index;
  if (!m.shards.empty() || !m.tensors.empty()) {
    return "an index (format version 4) lists shards or tensors; they belong in its parts";
  }
  if (!IsDigest(index.digest)) {
    return fmt::format("index's digest \"{}\" is not \"xxh3:\" and 16 lowercase hex digits", index.digest);
  }
  if (m.nodes.empty()) return "an index lists no \"nodes\"";
  if (index.parts.size() != m.nodes.size()) {
    return fmt::format("an index lists {} nodes but {} parts", m.nodes.size(), index.parts.size());
  }
  std::vector<bool> held(m.world_size, false);
  uint32_t ranks = 0;
  for (size_t i = 0; i < m.nodes.size(); ++i) {
    const ManifestNode& n = m.nodes[i];
    const ManifestPart& p = index.parts[i];
    if (i > 0 && n.node <= m.nodes[i - 1].node) return "an index's \"nodes\" are not in strictly ascending order";
    if (n.ranks.empty()) return fmt::format("node {} of the index holds no ranks", n.node);
    for (uint32_t r : n.ranks) {
      if (held[r]) return fmt::format("rank {} is on two nodes of the index", r);  // r < world_size: checked
      held[r] = true;
      ++ranks;
    }
    if (p.node != n.node || p.file != ManifestPartFileName(n.node)) {
      return fmt::format("the index's part {} is not node {}'s, {}", i, n.node, ManifestPartFileName(n.node));
    }
    if (!IsDigest(p.checksum)) {
      return fmt::format("node {}'s part checksum \"{}\" is not \"xxh3:\" and 16 lowercase hex digits", n.node,
                         p.checksum);
    }
  }
  if (ranks != m.world_size) {
    return fmt::format("the index's nodes hold {} of the {} ranks of the world", ranks, m.world_size);
  }
  return {};
}

// Why a version 5 piece's chunk size or extents are wrong for a piece of `bytes` of `dtype`
// of step `step`; empty when they are right.
std::string PieceChunkProblem(const TensorShard& shard, const std::string& dtype, uint64_t bytes,
                              const Increment& increment, uint64_t step) {
  absl::StatusOr<size_t> element = DTypeSize(dtype);
  if (!element.ok()) return std::string(element.status().message());
  if (shard.chunk_bytes == 0 || shard.chunk_bytes % *element != 0) {
    return fmt::format("chunk_bytes {} is not a positive multiple of {}'s {} bytes", shard.chunk_bytes, dtype, *element);
  }
  const uint64_t chunks = PieceChunks(bytes, shard.chunk_bytes);
  if (chunks > kMaxReadPieceChunks) {
    return fmt::format("{} chunks of {} bytes, more than the {} a piece may have", chunks, shard.chunk_bytes,
                       kMaxReadPieceChunks);
  }
  if (shard.extents.empty()) return {};
  return ExtentsProblem(shard.extents, chunks, shard.rank, increment, step);
}

// What a node-scoped manifest lists against what its scope says of the whole step; the
// shards are already known to ascend within the world. Empty when they agree, else why not.
std::string ScopeProblem(const Manifest& m) {
  const StepScope& scope = *m.scope;
  if (m.shards.empty()) return "a node-scoped manifest lists no shards";
  if (scope.nodes == 0 || scope.nodes > m.world_size) {
    return fmt::format("scope says {} nodes hold ranks of a step of world size {}", scope.nodes,
                       m.world_size);
  }
  // Every other node holds a rank at least.
  if (m.shards.size() > m.world_size - (scope.nodes - 1)) {
    return fmt::format("scope says {} nodes hold the {} ranks of the step, but node {} lists {} of them",
                       scope.nodes, m.world_size, scope.node, m.shards.size());
  }
  if (scope.step_bytes < m.total_bytes()) {
    return fmt::format("scope says the step holds {} bytes, fewer than the {} of node {}'s own shards",
                       scope.step_bytes, m.total_bytes(), scope.node);
  }
  if (scope.step_tensors < m.tensors.size()) {
    return fmt::format("scope says the step holds {} tensors, fewer than the {} node {} lists",
                       scope.step_tensors, m.tensors.size(), scope.node);
  }
  if (!IsDigest(scope.digest)) {
    return fmt::format("scope's digest \"{}\" is not \"xxh3:\" and 16 lowercase hex digits", scope.digest);
  }
  if (m.nodes.empty()) return {};
  if (m.nodes.size() != 1 || m.nodes[0].node != scope.node) {
    return fmt::format("\"nodes\" of node {}'s scoped manifest lists other nodes than node {} alone",
                       scope.node, scope.node);
  }
  std::vector<uint32_t> listed;
  for (const ManifestShard& s : m.shards) listed.push_back(s.rank);
  if (m.nodes[0].ranks != listed) {
    return fmt::format("\"nodes\" gives node {} ranks [{}], but its shards are ranks [{}]", scope.node,
                       fmt::join(m.nodes[0].ranks, ", "), fmt::join(listed, ", "));
  }
  return {};
}

}  // namespace

absl::StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& source,
                                       ManifestScope scope) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: invalid manifest: {}", source, why));
  };
  if (!j.is_object()) return bad("not a JSON object");
  try {
    if (j.value("format", "") != "ckptd-manifest") return bad("\"format\" is not ckptd-manifest");
    Manifest m;
    m.format_version = Int<int>(j.at("format_version"), "format_version");
    if (m.format_version > kManifestFormatVersion) {
      return bad(fmt::format("format version {} is newer than this ckptd understands ({})",
                             m.format_version, kManifestFormatVersion));
    }
    // Version 5 is the incremental step of any kind: a reader that knows 4 at most would
    // read none of its references.
    const bool incremental = m.format_version == kManifestIncrementFormatVersion;
    if (incremental) {
      m.increment = ParseIncrement(json_fields::Required(j, "manifest", "increment"));
    } else if (j.contains("increment")) {
      return bad(fmt::format("it has an \"increment\", which needs format version {}, not {}",
                             kManifestIncrementFormatVersion, m.format_version));
    }
    if (j.contains("scope") && j.contains("index")) return bad("it has both a \"scope\" and an \"index\"");
    // Version 3 is exactly the node-scoped manifest: a reader that took one without its
    // scope for a whole step would miss every other node's ranks.
    if (auto found = j.find("scope"); found != j.end()) {
      if (m.format_version != kManifestScopedFormatVersion && !incremental) {
        return bad(fmt::format("it has a \"scope\" (a node-scoped manifest), which needs format "
                               "version {}, not {} ({} in an incremental step)",
                               kManifestScopedFormatVersion, m.format_version, kManifestIncrementFormatVersion));
      }
      m.scope = ParseStepScope(*found);
    } else if (m.format_version == kManifestScopedFormatVersion) {
      return bad(fmt::format("format version {} is a node-scoped manifest, but it has no \"scope\"",
                             m.format_version));
    }
    // Version 4 is exactly the index: a reader that took one for a whole manifest would
    // find a step without tensors.
    if (auto found = j.find("index"); found != j.end()) {
      if (m.format_version != kManifestIndexFormatVersion && !incremental) {
        return bad(fmt::format("it has an \"index\", which needs format version {}, not {} ({} in an "
                               "incremental step)",
                               kManifestIndexFormatVersion, m.format_version, kManifestIncrementFormatVersion));
      }
      m.index = ParseStepIndex(*found);
    } else if (m.format_version == kManifestIndexFormatVersion) {
      return bad(fmt::format("format version {} is an index, but it has no \"index\"", m.format_version));
    }
    if (m.index && scope != ManifestScope::kWhole) return bad("an index is not a node's part");
    if (m.increment) {
      if (std::string problem = IncrementProblem(*m.increment, Int<uint64_t>(j.at("step"), "step"), m.index.has_value());
          !problem.empty()) {
        return bad(problem);
      }
    }
    m.job = j.at("job").get<std::string>();
    if (absl::Status valid = ValidateJobName(m.job); !valid.ok()) return bad(std::string(valid.message()));
    m.step = Int<uint64_t>(j.at("step"), "step");
    m.unix_time = Real(j.at("unix_time"), "unix_time");
    m.wall_time = j.at("wall_time").get<std::string>();
    m.world_size = Int<uint32_t>(j.at("world_size"), "world_size");
    // The group's own limit: a node-scoped manifest lists a few ranks of its world, and a
    // reader (verify's skipped ranks) must not be made to walk billions.
    if (m.world_size > kMaxManifestWorldSize) {
      return bad(fmt::format("world_size {} is over {}", m.world_size, kMaxManifestWorldSize));
    }
    m.ckptd_version = j.at("ckptd_version").get<std::string>();
    if (auto run = j.find("run"); run != j.end()) m.run = Int<uint64_t>(*run, "run");
    if (auto chunk = j.find("checksum_chunk_bytes"); chunk != j.end()) {
      m.checksum_chunk_bytes = Int<uint64_t>(*chunk, "checksum_chunk_bytes");
      if (m.checksum_chunk_bytes == 0) return bad("checksum_chunk_bytes is 0");
    }
    m.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    for (const auto& s : j.at("shards")) {
      ManifestShard shard;
      shard.rank = Int<uint32_t>(s.at("rank"), "rank");
      shard.file = s.at("file").get<std::string>();
      shard.bytes = Int<uint64_t>(s.at("bytes"), "bytes");
      shard.metadata = s.at("metadata").get<std::map<std::string, std::string>>();
      for (auto it = s.at("train_state").begin(); it != s.at("train_state").end(); ++it) {
        TrainStateEntry e;
        e.begin = Int<uint64_t>(it->at("data_offsets").at(0), "data_offsets");
        e.end = Int<uint64_t>(it->at("data_offsets").at(1), "data_offsets");
        e.checksum = it->at("checksum").get<std::string>();
        uint64_t file_bytes = shard.bytes;
        if (auto step = it->find("step"); step != it->end()) {
          e.step = Int<uint64_t>(*step, "train_state.step");
          const Origin* origin = m.increment ? m.increment->Find(*e.step, shard.rank) : nullptr;
          if (origin == nullptr) {
            return bad(fmt::format("train state {} of rank {} is in step {}, which the increment's origins do not "
                                   "list for rank {}",
                                   it.key(), shard.rank, *e.step, shard.rank));
          }
          file_bytes = origin->bytes;
        }
        if (e.begin > e.end || e.end > file_bytes) {
          return bad(fmt::format("train state {} of rank {}: byte range outside the file",
                                 it.key(), shard.rank));
        }
        shard.train_state[it.key()] = e;
      }
      if (m.scope) {
        if (shard.rank >= m.world_size) {
          return bad(fmt::format("shard of rank {} is outside the world of {} ranks", shard.rank,
                                 m.world_size));
        }
        if (!m.shards.empty() && shard.rank <= m.shards.back().rank) {
          return bad(fmt::format("shards are not in strictly ascending rank order: rank {} after "
                                 "rank {} (a node-scoped manifest lists each of its ranks once, in order)",
                                 shard.rank, m.shards.back().rank));
        }
      } else if (scope == ManifestScope::kWhole ? shard.rank != m.shards.size()
                                                : (shard.rank >= m.world_size ||
                                                   (!m.shards.empty() && shard.rank <= m.shards.back().rank))) {
        return bad("shards are not ranks 0..world_size-1");
      }
      if (incremental ? !IsTaggedShardFileName(shard.file, shard.rank) : shard.file != ShardFileName(shard.rank)) {
        return bad(fmt::format("rank {}'s shard file is not named {}", shard.rank,
                               incremental ? fmt::format("rank-{:05d}.<16 hex digits>.safetensors", shard.rank)
                                           : ShardFileName(shard.rank)));
      }
      m.shards.push_back(std::move(shard));
    }
    if (scope == ManifestScope::kWhole && !m.scope && !m.index && m.shards.size() != m.world_size) {
      return bad("shard count differs from world_size");
    }
    if (auto nodes = j.find("nodes"); nodes != j.end()) {
      for (const auto& n : *nodes) {
        m.nodes.push_back({Int<uint32_t>(n.at("node"), "node"), Ints<uint32_t>(n.at("ranks"), "ranks")});
        for (uint32_t r : m.nodes.back().ranks) {
          if (r >= m.world_size) return bad(fmt::format("node lists rank {} outside the world", r));
        }
      }
    }
    std::map<uint32_t, const ManifestShard*> by_rank;
    for (const ManifestShard& s : m.shards) by_rank[s.rank] = &s;
    for (auto it = j.at("tensors").begin(); it != j.at("tensors").end(); ++it) {
      ManifestTensor t;
      t.dtype = it->at("dtype").get<std::string>();
      t.global_shape = Ints<int64_t>(it->at("global_shape"), "global_shape");
      if (absl::Status valid = ValidateTensorName(it.key()); !valid.ok()) {
        return bad(std::string(valid.message()));
      }
      for (const auto& s : it->at("shards")) {
        TensorShard shard;
        shard.rank = Int<uint32_t>(s.at("rank"), "rank");
        if (auto extents = s.find("extents"); extents != s.end()) {
          if (!incremental || s.contains("file") || s.contains("data_offsets")) {
            return bad(fmt::format("tensor {}: rank {}'s piece has \"extents\", which need format version {} and "
                                   "no \"file\" or \"data_offsets\"",
                                   it.key(), shard.rank, kManifestIncrementFormatVersion));
          }
          shard.extents = ParseExtents(*extents);
        } else {
          shard.file = s.at("file").get<std::string>();
          shard.begin = Int<uint64_t>(s.at("data_offsets").at(0), "data_offsets");
          shard.end = Int<uint64_t>(s.at("data_offsets").at(1), "data_offsets");
        }
        if (incremental) shard.chunk_bytes = Int<uint64_t>(json_fields::Required(s, "tensor piece", "chunk_bytes"), "chunk_bytes");
        shard.shape = Ints<int64_t>(s.at("shape"), "shape");
        if (auto flat = s.find("flat"); flat != s.end()) {
          for (const auto& r : *flat) {
            shard.flat.push_back({Int<int64_t>(r.at(0), "flat"), Int<int64_t>(r.at(1), "flat")});
          }
        } else {
          shard.offset = Ints<int64_t>(s.at("offset"), "offset");
        }
        shard.checksum = s.at("checksum").get<std::string>();
        auto owner = by_rank.find(shard.rank);
        if (owner == by_rank.end() && m.scope) {
          return bad(fmt::format("tensor {}: a piece of rank {}, which node {}'s scoped manifest does "
                                 "not list (held by another node, or by none)",
                                 it.key(), shard.rank, m.scope->node));
        }
        if (owner == by_rank.end() || (shard.extents.empty() && shard.file != owner->second->file)) {
          return bad(fmt::format("tensor {}: a piece names rank {} or file {} that the shards "
                                 "list does not",
                                 it.key(), shard.rank, shard.file));
        }
        if (shard.begin > shard.end || shard.end > owner->second->bytes) {
          return bad(fmt::format("tensor {}: byte range [{}, {}) is not inside rank {}'s file",
                                 it.key(), shard.begin, shard.end, shard.rank));
        }
        if (absl::Status placed = CheckPlacement(shard, t.global_shape); !placed.ok()) {
          return bad(fmt::format("tensor {}: rank {}'s piece {}", it.key(), shard.rank, std::string(placed.message())));
        }
        absl::StatusOr<uint64_t> bytes = TensorBytes(it.key(), t.dtype, shard.shape);
        if (!bytes.ok()) return bad(std::string(bytes.status().message()));
        if (incremental) {
          if (std::string problem = PieceChunkProblem(shard, t.dtype, *bytes, *m.increment, m.step); !problem.empty()) {
            return bad(fmt::format("tensor {}: rank {}'s piece: {}", it.key(), shard.rank, problem));
          }
        }
        const uint64_t chunk_bytes = incremental ? shard.chunk_bytes : m.checksum_chunk_bytes;
        const uint64_t expected_chunks = ChecksumChunks(*bytes, chunk_bytes);
        if (auto chunks = s.find("chunk_checksums"); chunks != s.end()) {
          shard.chunk_checksums = chunks->get<std::vector<std::string>>();
        }
        // Optional only in manifests from before chunks were recorded.
        if ((s.contains("chunk_checksums") || (incremental && expected_chunks != 0)) &&
            shard.chunk_checksums.size() != expected_chunks) {
          return bad(fmt::format("tensor {}: rank {} lists {} chunk checksums for an entry of "
                                 "{} chunks",
                                 it.key(), shard.rank, shard.chunk_checksums.size(), expected_chunks));
        }
        if (!shard.extents.empty()) {
          t.shards.push_back(std::move(shard));
          continue;
        }
        if (*bytes != shard.end - shard.begin) {
          return bad(fmt::format("tensor {}: rank {}'s entry holds {} bytes; {} {} is {}",
                                 it.key(), shard.rank, shard.end - shard.begin, t.dtype,
                                 fmt::format("[{}]", fmt::join(shard.shape, ", ")), *bytes));
        }
        t.shards.push_back(std::move(shard));
      }
      m.tensors[it.key()] = std::move(t);
    }
    if (m.scope) {
      if (std::string problem = ScopeProblem(m); !problem.empty()) return bad(problem);
    }
    if (m.index) {
      if (std::string problem = IndexProblem(m); !problem.empty()) return bad(problem);
    }
    // Last, so that a manifest that is wrong in a named way says how.
    if (auto sum = j.find(kChecksumKey); sum != j.end()) {
      if (!sum->is_string() || sum->get<std::string>() != Digest(j)) {
        return bad("its checksum does not match its contents (edited or damaged)");
      }
    }
    return m;
  } catch (const json::exception& e) {
    return bad(e.what());
  } catch (const BadField& e) {
    return bad(e.what());
  }
}

}  // namespace ckpt::format

namespace ckpt::format {

absl::Status CheckPartsCoverWorld(const std::vector<std::pair<uint32_t, const Manifest*>>& parts) {
  if (parts.empty()) return absl::InvalidArgumentError("no manifest parts to merge");
  const Manifest& first = *parts.front().second;
  std::vector<bool> held(first.world_size, false);
  uint32_t ranks = 0;
  for (const auto& [node, part] : parts) {
    if (part->job != first.job || part->step != first.step || part->world_size != first.world_size) {
      return absl::FailedPreconditionError(fmt::format(
          "node {} prepared job {} step {} with world size {}; another node prepared job {} step {} "
          "with world size {}",
          node, part->job, part->step, part->world_size, first.job, first.step, first.world_size));
    }
    // One manifest records one chunk size for every piece's chunk checksums.
    if (part->checksum_chunk_bytes != first.checksum_chunk_bytes) {
      return absl::FailedPreconditionError(fmt::format(
          "node {} checksums chunks of {} bytes, another node chunks of {}", node, part->checksum_chunk_bytes,
          first.checksum_chunk_bytes));
    }
    for (const ManifestShard& s : part->shards) {
      if (s.rank >= held.size() || held[s.rank]) {
        return absl::FailedPreconditionError(
            s.rank >= held.size() ? fmt::format("rank {} is outside world size {}", s.rank, first.world_size)
                                  : fmt::format("rank {} of step {} was prepared twice", s.rank, first.step));
      }
      held[s.rank] = true;
      ++ranks;
    }
  }
  if (ranks != first.world_size) {
    std::vector<uint32_t> missing;
    for (uint32_t r = 0; r < held.size(); ++r) {
      if (!held[r]) missing.push_back(r);
    }
    return absl::FailedPreconditionError(fmt::format("step {} is missing ranks {}", first.step, fmt::join(missing, ", ")));
  }
  return absl::OkStatus();
}

absl::Status CheckSameTensor(const std::string& name, uint32_t node, const ManifestTensor& t,
                             const ManifestTensor& other) {
  if (t.dtype == other.dtype && t.global_shape == other.global_shape) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format("tensor {}: node {} has {} [{}], another node has {} [{}]", name,
                                                   node, t.dtype, fmt::join(t.global_shape, ","), other.dtype,
                                                   fmt::join(other.global_shape, ",")));
}

absl::StatusOr<Manifest> MergeManifestParts(const std::vector<std::pair<uint32_t, Manifest>>& parts) {
  std::vector<std::pair<uint32_t, const Manifest*>> refs;
  refs.reserve(parts.size());
  for (const auto& [node, part] : parts) refs.emplace_back(node, &part);
  if (absl::Status covered = CheckPartsCoverWorld(refs); !covered.ok()) return covered;
  const Manifest& first = parts.front().second;
  Manifest m;
  // With the chunk size of every piece's chunk_checksums: without it a whole manifest whose
  // pieces list chunk checksums would not parse back (each piece over 8 MiB has some).
  CopyStepHeader(first, m);
  m.run = 0;         // the nodes' latest, below
  m.metadata = {};   // rank 0's, below
  std::map<uint32_t, const ManifestShard*> by_rank;
  std::map<uint32_t, std::vector<uint32_t>> by_node;
  for (const auto& [node, part] : parts) {
    // The latest clock among the nodes: the moment the last part became durable.
    m.run = std::max(m.run, part.run);
    if (part.unix_time > m.unix_time) {
      m.unix_time = part.unix_time;
      m.wall_time = part.wall_time;
    }
    if (part.increment.has_value() != first.increment.has_value()) {
      return absl::FailedPreconditionError(fmt::format(
          "node {} prepared {} step, another node {}", node, part.increment ? "an incremental" : "a full-format",
          first.increment ? "an incremental one" : "a full-format one"));
    }
    if (part.increment) {
      if (!m.increment) m.increment.emplace();
      AddIncrement(*m.increment, *part.increment);
    }
    for (const ManifestShard& s : part.shards) {
      by_rank.emplace(s.rank, &s);
      by_node[node].push_back(s.rank);
    }
    for (const auto& [name, t] : part.tensors) {
      auto [it, inserted] = m.tensors.try_emplace(name, ManifestTensor{t.dtype, t.global_shape, {}});
      if (!inserted) {
        if (absl::Status same = CheckSameTensor(name, node, t, it->second); !same.ok()) return same;
      }
      it->second.shards.insert(it->second.shards.end(), t.shards.begin(), t.shards.end());
    }
  }
  for (const auto& [rank, shard] : by_rank) {
    m.shards.push_back(*shard);
    if (rank == 0) m.metadata = shard->metadata;
  }
  for (auto& [name, t] : m.tensors) {
    std::sort(t.shards.begin(), t.shards.end(),
              [](const TensorShard& a, const TensorShard& b) { return a.rank < b.rank; });
  }
  for (auto& [node, ranks] : by_node) {
    std::sort(ranks.begin(), ranks.end());
    m.nodes.push_back({node, ranks});
  }
  return m;
}

}  // namespace ckpt::format
