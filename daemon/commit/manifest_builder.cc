#include "daemon/commit/manifest_builder.h"

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>

#include "daemon/config.h"

namespace ckpt::daemon::commit {

absl::StatusOr<format::Manifest> BuildManifest(const std::string& job, uint64_t step,
                                                uint32_t world_size, const DurableShards& shards) {
  format::Manifest m;
  m.job = job;
  m.step = step;
  auto now = std::chrono::system_clock::now();
  m.unix_time = std::chrono::duration<double>(now.time_since_epoch()).count();
  m.wall_time = fmt::format("{:%Y-%m-%dT%H:%M:%SZ}",
                            fmt::gmtime(std::chrono::system_clock::to_time_t(now)));
  m.world_size = world_size;
  m.ckptd_version = kVersion;
  m.checksum_chunk_bytes = format::kChecksumChunkBytes;
  for (const auto& [rank, entry] : shards) {
    const auto& [snap, written] = entry;
    format::ManifestShard shard;
    shard.rank = rank;
    shard.file = written.file;
    shard.bytes = written.bytes;
    shard.metadata = snap->shard.metadata;
    m.run = std::max(m.run, snap->session_started_unix_ns);
    if (rank == 0) m.metadata = snap->shard.metadata;
    for (size_t i = 0; i < snap->shard.entries.size(); ++i) {
      const format::TensorEntry& e = snap->shard.entries[i];
      const std::string& checksum = written.checksums.at(e.name);
      if (i >= snap->tensor_count) {
        shard.train_state[snap->train_state_names[i - snap->tensor_count]] = {e.begin, e.end,
                                                                              checksum};
        continue;
      }
      const TensorPlacement& p = snap->placements[i];
      std::vector<int64_t> global = p.global_shape.empty() ? e.shape : p.global_shape;
      std::vector<int64_t> offset =
          p.offset.empty() ? std::vector<int64_t>(e.shape.size(), 0) : p.offset;
      auto [it, inserted] = m.tensors.try_emplace(e.name);
      format::ManifestTensor& t = it->second;
      if (inserted) {
        t.dtype = e.dtype;
        t.global_shape = global;
      } else if (t.dtype != e.dtype || t.global_shape != global) {
        return absl::InvalidArgumentError(fmt::format(
            "tensor {}: rank {} has {} [{}], another rank has {} [{}]", e.name, rank, e.dtype,
            fmt::join(global, ","), t.dtype, fmt::join(t.global_shape, ",")));
      }
      format::TensorShard piece;
      piece.rank = rank;
      piece.file = written.file;
      piece.begin = e.begin;
      piece.end = e.end;
      piece.shape = e.shape;
      piece.checksum = checksum;
      if (p.flat.empty()) {
        piece.offset = std::move(offset);
      } else {
        piece.flat = p.flat;
      }
      if (auto chunks = written.chunk_checksums.find(e.name); chunks != written.chunk_checksums.end()) {
        piece.chunk_checksums = chunks->second;
      }
      t.shards.push_back(std::move(piece));
    }
    m.shards.push_back(std::move(shard));
  }
  return m;
}

}  // namespace ckpt::daemon::commit
