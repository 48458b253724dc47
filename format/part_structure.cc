#include "format/part_structure.h"

#include "format/tiling.h"

#include "common/status.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <unordered_map>
#include <cmath>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>
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

// Moves `tensors` into `out`, each piece's placement into the coordinates, leaving the
// checksums behind (their number is the structure's).
void Pack(std::map<std::string, ManifestTensor>&& tensors, PackedTensors& out) {
  std::map<std::pair<uint32_t, std::string>, uint32_t> holders;  // a few: one per rank
  size_t pieces = 0;
  for (const auto& [name, tensor] : tensors) pieces += tensor.shards.size();
  out.tensors.reserve(tensors.size());
  out.pieces.reserve(pieces);
  auto add = [&](const std::vector<int64_t>& values) {
    out.coords.insert(out.coords.end(), values.begin(), values.end());
  };
  for (auto& [name, tensor] : tensors) {
    PackedTensors::Tensor& t = out.tensors.emplace_back();
    t.name = name;
    t.dtype = std::move(tensor.dtype);
    t.global_at = static_cast<uint32_t>(out.coords.size());
    t.dims = static_cast<uint32_t>(tensor.global_shape.size());
    add(tensor.global_shape);
    t.first = static_cast<uint32_t>(out.pieces.size());
    t.count = static_cast<uint32_t>(tensor.shards.size());
    for (TensorShard& s : tensor.shards) {
      auto [it, added] = holders.try_emplace({s.rank, std::move(s.file)}, static_cast<uint32_t>(out.holders.size()));
      if (added) out.holders.push_back({s.rank, it->first.second});
      PackedTensors::Piece& p = out.pieces.emplace_back();
      p.begin = s.begin;
      p.end = s.end;
      p.holder = it->second;
      p.at = static_cast<uint32_t>(out.coords.size());
      p.chunks = static_cast<uint32_t>(s.chunk_checksums.size());
      p.flat = static_cast<uint32_t>(s.flat.size());
      p.offset_dims = static_cast<uint32_t>(s.offset.size());
      p.shape_dims = static_cast<uint32_t>(s.shape.size());
      p.chunk_bytes = s.chunk_bytes;
      add(s.offset);
      add(s.shape);
      for (const ElementRange& r : s.flat) {
        out.coords.push_back(r.begin);
        out.coords.push_back(r.end);
      }
    }
    tensor.shards = {};  // freed as it goes: the part is not held twice
  }
  out.coords.shrink_to_fit();
}

// A version 5 part's places (PartValues::places) moved out of `m`, whose pieces and train
// state are left without them; returns how many pieces and train-state entries it had.
std::pair<size_t, size_t> TakePlaces(Manifest& m, std::vector<uint64_t>& places) {
  size_t pieces = 0, blobs = 0;
  for (auto& [name, tensor] : m.tensors) {
    for (TensorShard& piece : tensor.shards) {
      ++pieces;
      places.push_back(piece.extents.size());
      if (piece.extents.empty()) {
        places.push_back(piece.begin);
        places.push_back(piece.end);
      }
      for (const Extent& e : piece.extents) {
        places.insert(places.end(), {e.chunk_begin, e.chunk_end, e.step ? *e.step + 1 : 0, e.at});
      }
      piece.file.clear();  // a piece's file is its rank's, when it has one
      piece.begin = piece.end = 0;
      piece.extents = {};
    }
  }
  for (ManifestShard& shard : m.shards) {
    for (auto& [name, entry] : shard.train_state) {
      ++blobs;
      places.insert(places.end(), {entry.begin, entry.end, entry.step ? *entry.step + 1 : 0});
      entry.begin = entry.end = 0;
      entry.step.reset();
    }
  }
  return {pieces, blobs};
}

// Walks `places` as `pieces` pieces and `blobs` train-state entries, calling `piece(n, at)`
// with each piece's extent count and where its words begin, and `blob(at)` per entry.
// InvalidArgument when they are not that many, exactly.
template <typename Piece, typename Blob>
absl::Status WalkPlaces(const std::vector<uint64_t>& places, size_t pieces, size_t blobs, Piece&& piece, Blob&& blob) {
  size_t at = 0;
  auto bad = [&] {
    return absl::InvalidArgumentError(fmt::format("{} place values do not describe {} pieces and {} train-state entries",
                                                  places.size(), pieces, blobs));
  };
  for (size_t i = 0; i < pieces; ++i) {
    if (at >= places.size() || places[at] > kMaxReadPieceChunks) return bad();
    const uint64_t n = places[at++];
    const uint64_t words = n == 0 ? 2 : 4 * n;
    if (places.size() - at < words) return bad();
    piece(n, at);
    at += words;
  }
  for (size_t i = 0; i < blobs; ++i) {
    if (places.size() - at < 3) return bad();
    blob(at);
    at += 3;
  }
  return at == places.size() ? absl::OkStatus() : bad();
}

std::optional<uint64_t> StepOf(uint64_t word) {
  return word == 0 ? std::nullopt : std::optional<uint64_t>(word - 1);
}

// Puts `places` back into `m`, a version 5 part joined from its structure.
absl::Status PutPlaces(Manifest& m, const std::vector<uint64_t>& places, size_t pieces, size_t blobs) {
  std::vector<TensorShard*> all_pieces;
  all_pieces.reserve(pieces);
  for (auto& [name, tensor] : m.tensors) {
    for (TensorShard& piece : tensor.shards) all_pieces.push_back(&piece);
  }
  std::vector<TrainStateEntry*> all_blobs;
  all_blobs.reserve(blobs);
  for (ManifestShard& shard : m.shards) {
    for (auto& [name, entry] : shard.train_state) all_blobs.push_back(&entry);
  }
  if (all_pieces.size() != pieces || all_blobs.size() != blobs) {
    return absl::InvalidArgumentError("the structure does not have the pieces it counts");
  }
  size_t next_piece = 0, next_blob = 0;
  return WalkPlaces(
      places, pieces, blobs,
      [&](uint64_t n, size_t at) {
        TensorShard& piece = *all_pieces[next_piece++];
        if (n == 0) {
          const ManifestShard* shard = m.Shard(piece.rank);
          piece.file = shard ? shard->file : std::string();
          piece.begin = places[at];
          piece.end = places[at + 1];
          return;
        }
        for (uint64_t e = 0; e < n; ++e, at += 4) {
          piece.extents.push_back({static_cast<uint32_t>(places[at]), static_cast<uint32_t>(places[at + 1]),
                                   StepOf(places[at + 2]), places[at + 3]});
        }
      },
      [&](size_t at) {
        TrainStateEntry& entry = *all_blobs[next_blob++];
        entry.begin = places[at];
        entry.end = places[at + 1];
        entry.step = StepOf(places[at + 2]);
      });
}

}  // namespace

size_t PackedTensors::bytes() const {
  size_t names = 0;
  for (const Tensor& t : tensors) {
    names += (t.name.size() > 15 ? t.name.capacity() + 1 : 0) + (t.dtype.size() > 15 ? t.dtype.capacity() + 1 : 0);
  }
  size_t files = 0;
  for (const Holder& h : holders) files += sizeof(Holder) + h.file.capacity();
  return sizeof(Tensor) * tensors.capacity() + names + sizeof(Piece) * pieces.capacity() +
         sizeof(int64_t) * coords.capacity() + files;
}

ManifestTensor PackedTensors::Unpack(size_t i) const {
  const Tensor& t = tensors.at(i);
  ManifestTensor out;
  out.dtype = t.dtype;
  out.global_shape.assign(coords.begin() + t.global_at, coords.begin() + t.global_at + t.dims);
  out.shards.reserve(t.count);
  for (uint32_t k = t.first; k < t.first + t.count; ++k) {
    const Piece& p = pieces[k];
    TensorShard& s = out.shards.emplace_back();
    s.rank = holders[p.holder].rank;
    s.file = holders[p.holder].file;
    s.begin = p.begin;
    s.end = p.end;
    auto at = coords.begin() + p.at;
    s.offset.assign(at, at + p.offset_dims);
    at += p.offset_dims;
    s.shape.assign(at, at + p.shape_dims);
    at += p.shape_dims;
    s.flat.reserve(p.flat);
    for (uint32_t r = 0; r < p.flat; ++r, at += 2) s.flat.push_back({at[0], at[1]});
    s.chunk_checksums.resize(p.chunks);
    s.chunk_bytes = p.chunk_bytes;
  }
  return out;
}

size_t PartStructure::bytes() const {
  size_t shards = 0;
  for (const ManifestShard& s : structure.shards) {
    shards += sizeof(ManifestShard) + s.file.capacity();
    for (const auto& [name, entry] : s.train_state) shards += 96 + name.capacity() + entry.checksum.capacity();
  }
  return sizeof(PartStructure) + tensors.bytes() + shards + 16 * ranks.size();
}

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
  if (s.increment) {
    // Version 5: byte ranges and extents change every step, and so does the increment; the
    // structure keeps only that it is incremental (its text says version 5).
    v.increment = std::exchange(*s.increment, {});
    std::tie(structure->located_pieces, structure->located_blobs) = TakePlaces(s, v.places);
    structure->incremental = true;
  }
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
  Pack(std::exchange(s.tensors, {}), structure->tensors);
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
  if (values.increment.has_value() != structure.incremental) {
    return absl::InvalidArgumentError(fmt::format("values {} an increment, but structure {} is {}incremental",
                                                  values.increment ? "carry" : "lack", structure.digest,
                                                  structure.incremental ? "" : "not "));
  }
  if (!structure.incremental) {
    if (!values.places.empty()) return absl::InvalidArgumentError("values place pieces of a part not incremental");
  } else if (!values.withheld || !values.places.empty()) {
    CKPT_RETURN_IF_ERROR(WalkPlaces(values.places, structure.located_pieces, structure.located_blobs,
                                    [](uint64_t, size_t) {}, [](size_t) {}));
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
  summary->incremental = structure.incremental;
  summary->located_pieces = structure.located_pieces;
  summary->located_blobs = structure.located_blobs;
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
  v.increment = increment;
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
  for (size_t i = 0; i < structure.tensors.tensors.size(); ++i) {
    m.tensors.emplace_hint(m.tensors.end(), structure.tensors.tensors[i].name, structure.tensors.Unpack(i));
  }
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
  if (structure.incremental) {
    m.increment = values.increment;
    CKPT_RETURN_IF_ERROR(PutPlaces(m, values.places, structure.located_pieces, structure.located_blobs));
  }
  return m;
}

}  // namespace ckpt::format

namespace ckpt::format {

absl::StatusOr<uint32_t> CheckStructuresTile(const std::vector<std::pair<uint32_t, const PartStructure*>>& parts) {
  std::vector<std::pair<uint32_t, const Manifest*>> manifests;  // all but their tensors
  manifests.reserve(parts.size());
  for (const auto& [node, part] : parts) {
    if (part->summary) {
      return absl::FailedPreconditionError(
          fmt::format("node {}'s structure {} is held as a summary only", node, part->digest));
    }
    manifests.emplace_back(node, &part->structure);
  }
  if (absl::Status covered = CheckPartsCoverWorld(manifests); !covered.ok()) return covered;
  // Each tensor's entry in every part that has it: (part, tensor index), by name.
  std::unordered_map<std::string_view, std::vector<std::pair<uint32_t, uint32_t>>> by_name;
  for (uint32_t p = 0; p < parts.size(); ++p) {
    const PackedTensors& packed = parts[p].second->tensors;
    for (uint32_t i = 0; i < packed.tensors.size(); ++i) by_name[packed.tensors[i].name].emplace_back(p, i);
  }
  std::vector<std::string_view> names;
  names.reserve(by_name.size());
  for (const auto& [name, entries] : by_name) names.push_back(name);
  std::sort(names.begin(), names.end());  // the same first error whatever the hash order
  for (std::string_view name : names) {
    const std::vector<std::pair<uint32_t, uint32_t>>& entries = by_name.at(name);
    const std::string text(name);
    ManifestTensor merged;
    bool seeded = false;  // by the first entry, whatever it holds (a dtype may be empty)
    for (const auto& [p, i] : entries) {
      ManifestTensor t = parts[p].second->tensors.Unpack(i);
      if (!seeded) {
        merged.dtype = t.dtype;
        merged.global_shape = t.global_shape;
        seeded = true;
      } else if (absl::Status same = CheckSameTensor(text, parts[p].first, t, merged); !same.ok()) {
        return same;
      }
      std::move(t.shards.begin(), t.shards.end(), std::back_inserter(merged.shards));
    }
    std::stable_sort(merged.shards.begin(), merged.shards.end(),
                     [](const TensorShard& a, const TensorShard& b) { return a.rank < b.rank; });
    if (absl::Status tiled = CheckTensorTiling(text, merged); !tiled.ok()) return tiled;
  }
  return static_cast<uint32_t>(names.size());
}

}  // namespace ckpt::format
