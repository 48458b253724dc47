#include "daemon/restore/snapshot_manifest.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "common/dtype.h"

namespace ckpt::daemon {
namespace {

// A snapshot's entries by name: its tensors, and its train-state blobs by their names.
struct SnapshotEntries {
  const StagedSnapshot* snap = nullptr;
  std::map<std::string, const format::TensorEntry*> tensors;
  std::map<std::string, const format::TensorEntry*> train_state;
};

}  // namespace

absl::StatusOr<format::Manifest> SnapshotManifest(const format::Manifest& committed,
                                                  const std::vector<StagedSnapshotPtr>& snapshots) {
  if (!committed.increment) return committed;
  std::map<uint32_t, SnapshotEntries> by_rank;
  for (const StagedSnapshotPtr& snap : snapshots) {
    SnapshotEntries& e = by_rank[snap->rank];
    e.snap = snap.get();
    for (size_t i = 0; i < snap->shard.entries.size(); ++i) {
      const format::TensorEntry& entry = snap->shard.entries[i];
      if (i < snap->tensor_count) {
        e.tensors[entry.name] = &entry;
      } else if (i - snap->tensor_count < snap->train_state_names.size()) {
        e.train_state[snap->train_state_names[i - snap->tensor_count]] = &entry;
      }
    }
  }
  auto unlike = [&](const std::string& what, uint32_t rank) {
    return absl::FailedPreconditionError(fmt::format(
        "step {} of job {}: rank {}'s {} is not in its staged snapshot as committed (no entry of that name and size)",
        committed.step, committed.job, rank, what));
  };

  format::Manifest m = committed;
  uint64_t committed_bytes = 0;  // of the shards converted, as committed (their own files)
  for (format::ManifestShard& shard : m.shards) {
    auto it = by_rank.find(shard.rank);
    if (it == by_rank.end()) {
      return absl::FailedPreconditionError(fmt::format("step {} of job {}: this node's manifest lists rank {}, whose "
                                                       "staged snapshot it was not given",
                                                       committed.step, committed.job, shard.rank));
    }
    committed_bytes += shard.bytes;
    shard.bytes = it->second.snap->shard.data_bytes;
    for (auto& [name, blob] : shard.train_state) {
      auto entry = it->second.train_state.find(name);
      if (entry == it->second.train_state.end() || entry->second->end - entry->second->begin != blob.end - blob.begin) {
        return unlike("train state " + name, shard.rank);
      }
      blob.begin = entry->second->begin;
      blob.end = entry->second->end;
      blob.step.reset();
    }
  }
  for (auto& [name, tensor] : m.tensors) {
    for (format::TensorShard& piece : tensor.shards) {
      const format::ManifestShard* shard = m.Shard(piece.rank);
      auto snap = by_rank.find(piece.rank);
      if (shard == nullptr || snap == by_rank.end()) return unlike("piece of tensor " + name, piece.rank);
      auto entry = snap->second.tensors.find(name);
      absl::StatusOr<uint64_t> bytes = TensorBytes(name, tensor.dtype, piece.shape);
      if (entry == snap->second.tensors.end() || !bytes.ok() || entry->second->end - entry->second->begin != *bytes) {
        return unlike("piece of tensor " + name, piece.rank);
      }
      piece.file = shard->file;
      piece.begin = entry->second->begin;
      piece.end = entry->second->end;
      piece.extents.clear();
    }
  }
  // The step as the peers hold it: these ranks' snapshots whole, nothing referenced. The
  // whole step's figures count these ranks at their snapshots' size instead of their files'.
  uint64_t snapshot_bytes = 0;
  for (const format::ManifestShard& shard : m.shards) snapshot_bytes += shard.bytes;
  if (m.scope) m.scope->step_bytes = m.scope->step_bytes - std::min(m.scope->step_bytes, committed_bytes) + snapshot_bytes;
  m.increment = format::Increment{};
  m.increment->own_bytes = m.StepBytes();
  return m;
}

}  // namespace ckpt::daemon
