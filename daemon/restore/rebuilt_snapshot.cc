#include "daemon/restore/rebuilt_snapshot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <utility>

#include "common/dtype.h"
#include "format/checksum.h"

namespace ckpt::daemon {
namespace {

// The bytes [begin, end) of `data`, checked: within it, and hashing to `checksum`.
absl::Status CheckEntry(std::string_view data, const std::string& what, uint64_t begin, uint64_t end,
                        const std::string& checksum, uint64_t step) {
  if (begin > end || end > data.size()) {
    return absl::DataLossError(fmt::format("step {}: {} at [{}, {}) is outside the rebuilt shard of {} bytes", step,
                                           what, begin, end, data.size()));
  }
  if (const std::string sum = format::ChecksumOf(data.data() + begin, end - begin); sum != checksum) {
    return absl::DataLossError(fmt::format("step {}: {} rebuilt from peers hashes to {}, the manifest says {}", step,
                                           what, sum, checksum));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StagedSnapshotPtr> RebuiltSnapshot(const format::Manifest& manifest, uint32_t rank, ShardBytes shard) {
  const std::string_view data(shard.data.get(), shard.size);
  const format::ManifestShard* saved = manifest.Shard(rank);
  if (saved == nullptr) {
    return absl::FailedPreconditionError(fmt::format("this node's manifest of step {} has no shard of rank {}",
                                                     manifest.step, rank));
  }
  auto snap = std::make_shared<StagedSnapshot>();
  snap->job = manifest.job;
  snap->step = manifest.step;
  snap->rank = rank;
  snap->world_size = manifest.world_size;
  snap->shard.rank = rank;
  snap->shard.metadata = saved->metadata;
  std::set<std::string> names;
  for (const auto& [name, tensor] : manifest.tensors) {
    for (const format::TensorShard& piece : tensor.shards) {
      if (piece.rank != rank) continue;
      if (!piece.extents.empty()) {
        // What the peers hold is the snapshot: every piece whole (SnapshotManifest).
        return absl::FailedPreconditionError(fmt::format(
            "step {}: rank {}'s piece of tensor {} is referenced in other steps' files, not placed in the rebuilt "
            "shard (a manifest of the files on disk, not of the snapshot the peers hold)",
            manifest.step, rank, name));
      }
      if (!names.insert(name).second) {
        return absl::FailedPreconditionError(
            fmt::format("step {}: rank {} saved two pieces of tensor {}", manifest.step, rank, name));
      }
      if (absl::Status s = CheckEntry(data, "tensor " + name, piece.begin, piece.end, piece.checksum, manifest.step);
          !s.ok()) {
        return s;
      }
      // The bytes its dtype and shape make: a restore copies that many from `begin`.
      absl::StatusOr<size_t> item = DTypeSize(tensor.dtype);
      uint64_t elements = 1;
      bool overflow = false;
      for (int64_t d : piece.shape) {
        overflow |= d < 0 || (d > 0 && elements > UINT64_MAX / static_cast<uint64_t>(d));
        if (!overflow) elements *= static_cast<uint64_t>(d);
      }
      if (!item.ok() || overflow || elements > UINT64_MAX / *item || elements * *item != piece.end - piece.begin) {
        return absl::DataLossError(fmt::format("step {}: tensor {} of rank {} spans {} bytes, which its dtype {} and "
                                               "shape do not make",
                                               manifest.step, name, rank, piece.end - piece.begin, tensor.dtype));
      }
      snap->shard.entries.push_back({name, tensor.dtype, piece.shape, piece.begin, piece.end});
      snap->placements.push_back({tensor.global_shape, piece.offset, piece.flat});
    }
  }
  // In data order, as staging laid them out (the placements follow their entries).
  std::vector<size_t> order(snap->shard.entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return snap->shard.entries[a].begin < snap->shard.entries[b].begin; });
  std::vector<format::TensorEntry> entries;
  std::vector<TensorPlacement> placements;
  for (size_t i : order) {
    entries.push_back(std::move(snap->shard.entries[i]));
    placements.push_back(std::move(snap->placements[i]));
  }
  snap->shard.entries = std::move(entries);
  snap->placements = std::move(placements);
  snap->tensor_count = snap->shard.entries.size();
  for (const auto& [name, blob] : saved->train_state) {
    if (blob.step) {
      return absl::FailedPreconditionError(fmt::format(
          "step {}: rank {}'s train state {} is referenced in step {}'s file, not placed in the rebuilt shard",
          manifest.step, rank, name, *blob.step));
    }
    if (absl::Status s = CheckEntry(data, "train state " + name, blob.begin, blob.end, blob.checksum, manifest.step);
        !s.ok()) {
      return s;
    }
    snap->shard.entries.push_back(
        {format::TrainStateKey(name), "U8", {static_cast<int64_t>(blob.end - blob.begin)}, blob.begin, blob.end});
    snap->train_state_names.push_back(name);
  }
  snap->shard.region = ScatteredBytes(shard.data.get(), shard.size);
  snap->shard.data_bytes = shard.size;
  snap->rebuilt = std::move(shard.data);
  return snap;
}

}  // namespace ckpt::daemon
