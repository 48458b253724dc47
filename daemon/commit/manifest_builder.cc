#include "daemon/commit/manifest_builder.h"

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>

#include "common/status.h"
#include "daemon/config.h"
#include "daemon/persist/increment_plan.h"

namespace ckpt::daemon::commit {
namespace {

// The tensor's global shape: its placement's, or the piece's own when it is the whole tensor.
std::vector<int64_t> GlobalShape(const format::TensorEntry& e, const TensorPlacement& p) {
  return p.global_shape.empty() ? e.shape : p.global_shape;
}

// A tensor of rank `rank` joins `m.tensors`, or must agree with the other ranks' pieces.
absl::StatusOr<format::ManifestTensor*> TensorOf(format::Manifest& m, const std::string& name, uint32_t rank,
                                                 const std::string& dtype, const std::vector<int64_t>& global) {
  auto [it, inserted] = m.tensors.try_emplace(name);
  format::ManifestTensor& t = it->second;
  if (inserted) {
    t.dtype = dtype;
    t.global_shape = global;
  } else if (t.dtype != dtype || t.global_shape != global) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: rank {} has {} [{}], another rank has {} [{}]", name,
                                                  rank, dtype, fmt::join(global, ","), t.dtype,
                                                  fmt::join(t.global_shape, ",")));
  }
  return &t;
}

// A rank written in format version 5 (--increments on): its pieces, train state and share of
// the step's increment, as its write was planned.
absl::Status AddPlannedRank(const StagedSnapshot& snap, const persist::WrittenShard& written, format::Manifest& m,
                            format::ManifestShard& shard) {
  const persist::RankWritePlan& plan = *written.plan;
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const format::TensorEntry& e = snap.shard.entries[i];
    const TensorPlacement& p = snap.placements[i];
    CKPT_ASSIGN_OR_RETURN(format::ManifestTensor * t, TensorOf(m, e.name, snap.rank, e.dtype, GlobalShape(e, p)));
    t->shards.push_back(plan.pieces[i].shard);
  }
  shard.train_state = plan.train_state;
  if (!m.increment) m.increment.emplace();
  format::AddIncrement(*m.increment, persist::PlanIncrement(plan, written.bytes));
  return absl::OkStatus();
}

}  // namespace

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
    if (written.plan != nullptr) {
      CKPT_RETURN_IF_ERROR(AddPlannedRank(*snap, written, m, shard));
      m.shards.push_back(std::move(shard));
      continue;
    }
    for (size_t i = 0; i < snap->shard.entries.size(); ++i) {
      const format::TensorEntry& e = snap->shard.entries[i];
      const std::string& checksum = written.checksums.at(e.name);
      if (i >= snap->tensor_count) {
        shard.train_state[snap->train_state_names[i - snap->tensor_count]] = {e.begin, e.end,
                                                                              checksum};
        continue;
      }
      const TensorPlacement& p = snap->placements[i];
      std::vector<int64_t> offset =
          p.offset.empty() ? std::vector<int64_t>(e.shape.size(), 0) : p.offset;
      CKPT_ASSIGN_OR_RETURN(format::ManifestTensor * t, TensorOf(m, e.name, rank, e.dtype, GlobalShape(e, p)));
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
      t->shards.push_back(std::move(piece));
    }
    m.shards.push_back(std::move(shard));
  }
  return m;
}

}  // namespace ckpt::daemon::commit
