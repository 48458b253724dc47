#include "daemon/persist/increment_base.h"

#include <fmt/format.h>

#include "common/dtype.h"
#include "daemon/persist/increment_chunks.h"
#include "format/checksum.h"

namespace ckpt::persist {
namespace {

// The index into base.files of the rank's origin file of `step`, added on first use.
absl::StatusOr<uint32_t> FileOf(RankBase& base, const format::Increment& increment, uint64_t step) {
  for (uint32_t i = 0; i < base.files.size(); ++i) {
    if (base.files[i].step == step) return i;
  }
  const format::Origin* origin = increment.Find(step, base.rank);
  if (origin == nullptr) {
    return absl::InvalidArgumentError(
        fmt::format("step {} references step {} for rank {}, which its origins do not list", base.step, step, base.rank));
  }
  base.files.push_back(*origin);
  return static_cast<uint32_t>(base.files.size() - 1);
}

absl::StatusOr<uint64_t> Checksum(const std::string& text, const std::string& what) {
  std::optional<uint64_t> value = format::ParseChecksumText(text);
  if (!value) return absl::InvalidArgumentError(fmt::format("{}: checksum \"{}\" is not xxh3:<16 hex>", what, text));
  return *value;
}

// The chunks of `piece` (a version 5 piece of `bytes`), or nullopt when the base cannot
// describe it.
absl::StatusOr<std::optional<PieceBase>> PieceOf(RankBase& base, const format::Increment& increment,
                                                 const std::string& name, const format::ManifestTensor& tensor,
                                                 const format::TensorShard& piece) {
  absl::StatusOr<uint64_t> bytes = TensorBytes(name, tensor.dtype, piece.shape);
  if (!bytes.ok()) return bytes.status();
  if (piece.chunk_bytes == 0) return std::nullopt;
  PieceBase out{tensor.dtype, piece.shape, piece.offset, piece.flat, *bytes, piece.chunk_bytes, {}};
  const uint64_t chunks = format::PieceChunks(*bytes, piece.chunk_bytes);
  if (chunks > 1 && piece.chunk_checksums.size() != chunks) return std::nullopt;
  out.chunks.resize(chunks);
  for (uint64_t c = 0; c < chunks; ++c) {
    const std::string what = fmt::format("tensor {}: rank {}'s chunk {}", name, base.rank, c);
    absl::StatusOr<uint64_t> sum = Checksum(chunks > 1 ? piece.chunk_checksums[c] : piece.checksum, what);
    if (!sum.ok()) return sum.status();
    out.chunks[c].checksum = *sum;
  }
  if (piece.extents.empty()) {  // whole in the step's own file
    for (uint64_t c = 0; c < chunks; ++c) {
      out.chunks[c].at = piece.begin + c * piece.chunk_bytes;
      out.chunks[c].continues = c > 0;
    }
    return out;
  }
  for (const format::Extent& e : piece.extents) {
    uint32_t file = 0;
    if (e.step) {
      absl::StatusOr<uint32_t> origin = FileOf(base, increment, *e.step);
      if (!origin.ok()) return origin.status();
      file = *origin;
    }
    for (uint64_t c = e.chunk_begin; c < e.chunk_end && c < chunks; ++c) {
      out.chunks[c].at = e.at + (c - e.chunk_begin) * piece.chunk_bytes;
      out.chunks[c].file = file;
      out.chunks[c].continues = c > e.chunk_begin;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<RankBase> BaseFromManifest(const format::Manifest& manifest, uint32_t rank) {
  if (!manifest.increment || manifest.format_version < format::kManifestIncrementFormatVersion) {
    return absl::FailedPreconditionError(fmt::format(
        "step {} is format version {}: only version {} files are referenced (their names are tagged)", manifest.step,
        manifest.format_version, format::kManifestIncrementFormatVersion));
  }
  if (manifest.index) {
    return absl::FailedPreconditionError(
        fmt::format("step {}'s manifest is an index: a rank's base is read from its node's part", manifest.step));
  }
  const format::ManifestShard* shard = manifest.Shard(rank);
  if (shard == nullptr) return absl::NotFoundError(fmt::format("step {} does not list rank {}", manifest.step, rank));
  RankBase base;
  base.step = manifest.step;
  base.run = manifest.run;
  base.rank = rank;
  base.files.push_back({manifest.step, manifest.run, rank, shard->file, shard->bytes});
  const format::Increment& increment = *manifest.increment;
  for (const auto& [name, tensor] : manifest.tensors) {
    const format::TensorShard* mine = nullptr;
    int count = 0;
    for (const format::TensorShard& piece : tensor.shards) {
      if (piece.rank == rank) mine = &piece, ++count;
    }
    if (count != 1) continue;
    absl::StatusOr<std::optional<PieceBase>> piece = PieceOf(base, increment, name, tensor, *mine);
    if (!piece.ok()) return piece.status();
    if (*piece) base.pieces.emplace(name, std::move(**piece));
  }
  for (const auto& [name, entry] : shard->train_state) {
    absl::StatusOr<uint64_t> sum = Checksum(entry.checksum, fmt::format("train state {} of rank {}", name, rank));
    if (!sum.ok()) return sum.status();
    uint32_t file = 0;
    if (entry.step) {
      absl::StatusOr<uint32_t> origin = FileOf(base, increment, *entry.step);
      if (!origin.ok()) return origin.status();
      file = *origin;
    }
    base.train_state[name] = BlobWhere{*sum, entry.end - entry.begin, entry.begin, file};
  }
  return base;
}

}  // namespace ckpt::persist
