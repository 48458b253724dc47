#include "format/part_structure.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string_view>
#include <utility>

namespace ckpt::format {
namespace {

// Calls `slot(std::string&)` on every checksum of `m`, in PartValues::checksums order. The
// structure keeps each slot, empty, so that a values list fits it by position.
template <typename ManifestT, typename Slot>
void ForEachChecksum(ManifestT& m, Slot&& slot) {
  for (auto& [name, tensor] : m.tensors) {
    for (auto& piece : tensor.shards) {
      slot(piece.checksum);
      for (auto& chunk : piece.chunk_checksums) slot(chunk);
    }
  }
  for (auto& shard : m.shards) {
    for (auto& [name, entry] : shard.train_state) slot(entry.checksum);
  }
}

// The value of "xxh3:" and 16 lowercase hex digits, as Checksum writes it.
std::optional<uint64_t> Xxh3Value(const std::string& text) {
  constexpr std::string_view kPrefix = "xxh3:";
  if (text.size() != kPrefix.size() + 16 || text.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  uint64_t value = 0;
  for (size_t i = kPrefix.size(); i < text.size(); ++i) {
    const char c = text[i];
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  return value;
}

// Moves `v.checksums` into `v.xxh3` when every one is in the form ckptd writes.
void PackChecksums(PartValues& v) {
  std::vector<uint64_t> packed;
  packed.reserve(v.checksums.size());
  for (const std::string& c : v.checksums) {
    std::optional<uint64_t> value = Xxh3Value(c);
    if (!value) return;
    packed.push_back(*value);
  }
  if (packed.empty()) return;
  v.xxh3 = std::move(packed);
  v.checksums.clear();
}

}  // namespace

SplitResult SplitPart(const Manifest& part) {
  SplitResult out;
  auto structure = std::make_shared<PartStructure>();
  Manifest& s = structure->structure;
  s = part;
  PartValues& v = out.values;
  v.step = part.step;
  v.run = part.run;
  v.unix_time = part.unix_time;
  v.wall_time = part.wall_time;
  v.metadata = part.metadata;
  s.step = 0;
  s.run = 0;
  s.unix_time = 0;
  s.wall_time.clear();
  s.metadata.clear();
  for (ManifestShard& shard : s.shards) {
    v.ranks.push_back({shard.bytes, std::move(shard.metadata)});
    shard.bytes = 0;
    shard.metadata.clear();
  }
  ForEachChecksum(s, [&](std::string& checksum) { v.checksums.push_back(std::exchange(checksum, {})); });
  PackChecksums(v);
  std::map<uint32_t, uint64_t> ends;  // by rank
  for (const auto& [name, tensor] : s.tensors) {
    for (const TensorShard& piece : tensor.shards) ends[piece.rank] = std::max(ends[piece.rank], piece.end);
  }
  for (const ManifestShard& shard : s.shards) {
    uint64_t end = ends[shard.rank];
    for (const auto& [name, entry] : shard.train_state) end = std::max(end, entry.end);
    structure->min_bytes.push_back(end);
    structure->ranks.push_back(shard.rank);
  }
  const std::string json = ManifestToJson(s);
  structure->digest = ManifestDigest(json);
  structure->json_bytes = json.size();
  structure->checksums = v.checksum_count();
  out.structure = std::move(structure);
  return out;
}

absl::Status CheckValuesFit(const PartStructure& structure, const PartValues& values) {
  if (values.ranks.size() != structure.ranks.size()) {
    return absl::InvalidArgumentError(fmt::format("values for {} ranks, but structure {} has {}",
                                                  values.ranks.size(), structure.digest,
                                                  structure.ranks.size()));
  }
  for (size_t i = 0; i < values.ranks.size() && i < structure.min_bytes.size(); ++i) {
    if (values.ranks[i].bytes < structure.min_bytes[i]) {
      return absl::InvalidArgumentError(fmt::format(
          "rank {} holds {} bytes, less than the end of its entries ({})", structure.ranks[i],
          values.ranks[i].bytes, structure.min_bytes[i]));
    }
  }
  if (!std::isfinite(values.unix_time) || values.unix_time < 0) {
    return absl::InvalidArgumentError(fmt::format("unix_time {} is not a time", values.unix_time));
  }
  if (!values.xxh3.empty() + !values.checksums.empty() + (values.withheld > 0) > 1) {
    return absl::InvalidArgumentError("checksums come as xxh3 values, as text or as a count, not more than one");
  }
  if (values.checksum_count() != structure.checksums) {
    return absl::InvalidArgumentError(fmt::format("{} checksums, but structure {} has {}",
                                                  values.checksum_count(), structure.digest,
                                                  structure.checksums));
  }
  return absl::OkStatus();
}

std::shared_ptr<const PartStructure> Summarize(const PartStructure& structure) {
  auto summary = std::make_shared<PartStructure>();
  summary->structure.job = structure.structure.job;
  summary->structure.world_size = structure.structure.world_size;
  summary->structure.ckptd_version = structure.structure.ckptd_version;
  summary->structure.shards.reserve(structure.structure.shards.size());
  for (const ManifestShard& shard : structure.structure.shards) {
    summary->structure.shards.push_back({shard.rank, shard.file, shard.bytes, {}, {}});  // no train state
  }
  summary->digest = structure.digest;
  summary->json_bytes = structure.json_bytes;
  summary->checksums = structure.checksums;
  summary->min_bytes = structure.min_bytes;
  summary->ranks = structure.ranks;
  summary->summary = true;
  return summary;
}

PartValues PartValues::WithChecksumsWithheld() const {
  PartValues v;
  v.step = step;
  v.run = run;
  v.unix_time = unix_time;
  v.wall_time = wall_time;
  v.metadata = metadata;
  v.ranks = ranks;
  v.withheld = checksum_count();
  return v;
}

absl::StatusOr<Manifest> JoinPart(const PartStructure& structure, const PartValues& values) {
  if (structure.summary) {
    return absl::FailedPreconditionError(fmt::format("structure {} is held as a summary only", structure.digest));
  }
  if (absl::Status fits = CheckValuesFit(structure, values); !fits.ok()) return fits;
  if (values.withheld) {
    return absl::FailedPreconditionError(
        fmt::format("the checksums of a part of structure {} stayed on its node (only their count came)",
                    structure.digest));
  }
  Manifest m = structure.structure;
  m.step = values.step;
  m.run = values.run;
  m.unix_time = values.unix_time;
  m.wall_time = values.wall_time;
  m.metadata = values.metadata;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    m.shards[i].bytes = values.ranks[i].bytes;
    m.shards[i].metadata = values.ranks[i].metadata;
  }
  size_t next = 0;
  if (values.xxh3.empty()) {
    ForEachChecksum(m, [&](std::string& checksum) { checksum = values.checksums[next++]; });
  } else {
    ForEachChecksum(m, [&](std::string& checksum) { checksum = fmt::format("xxh3:{:016x}", values.xxh3[next++]); });
  }
  return m;
}

}  // namespace ckpt::format
