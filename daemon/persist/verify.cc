#include "daemon/persist/verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "common/status.h"
#include "daemon/persist/shard_reader.h"

namespace ckpt::persist {
namespace {

struct Expected {
  std::string name;
  uint64_t begin, end;
  std::string checksum;
  std::string dtype;  // empty for train-state entries (U8)
  std::vector<int64_t> shape;
};

// A shard shorter than the manifest says: the data region ends the file, so the manifest's
// offsets tell which entries the missing bytes belong to.
void ReportTruncatedEntries(Filesystem& fs, const std::string& path, uint64_t expected_bytes,
                            const std::vector<Expected>& entries, VerifyReport& report) {
  auto size = fs.FileSize(path);
  if (!size.ok() || *size >= expected_bytes) return;
  uint64_t data_bytes = 0;
  for (const Expected& e : entries) data_bytes = std::max(data_bytes, e.end);
  uint64_t data_start = expected_bytes - data_bytes;
  uint64_t available = *size > data_start ? *size - data_start : 0;
  for (const Expected& e : entries) {
    if (e.end > available) {
      report.problems.push_back(fmt::format(
          "tensor {} in {}: truncated ({} of its {} bytes missing)", e.name, path,
          e.end - std::max(e.begin, std::min(available, e.end)), e.end - e.begin));
    }
  }
}

}  // namespace

absl::StatusOr<VerifyReport> VerifyCheckpoint(CheckpointStore& store, const std::string& job,
                                              uint64_t step, std::optional<uint32_t> node) {
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, store.LoadManifest(job, step));
  VerifyReport report;
  std::vector<std::vector<Expected>> by_rank(manifest.world_size);
  for (const auto& [name, tensor] : manifest.tensors) {
    for (const TensorShard& s : tensor.shards) {
      by_rank[s.rank].push_back({name, s.begin, s.end, s.checksum, tensor.dtype, s.shape});
    }
  }
  std::vector<char> buffer;
  for (const ManifestShard& shard : manifest.shards) {
    if (auto holder = manifest.NodeOf(shard.rank); node && holder && *holder != *node) {
      report.skipped_ranks.push_back(shard.rank);
      continue;
    }
    for (const auto& [name, e] : shard.train_state) {
      by_rank[shard.rank].push_back({TrainStateKey(name), e.begin, e.end, e.checksum, "U8",
                                     {static_cast<int64_t>(e.end - e.begin)}});
    }
    std::string path = store.StepDir(job, step) + "/" + shard.file;
    auto reader = ShardReader::Open(store.fs(), path, shard.bytes);
    if (!reader.ok()) {
      report.problems.push_back(Message(reader.status()));
      ReportTruncatedEntries(store.fs(), path, shard.bytes, by_rank[shard.rank], report);
      continue;
    }
    for (const Expected& want : by_rank[shard.rank]) {
      const TensorEntry* entry = (*reader)->Find(want.name);
      if (entry == nullptr) {
        report.problems.push_back(fmt::format("tensor {} missing from {}", want.name, path));
        continue;
      }
      if (entry->begin != want.begin || entry->end != want.end || entry->dtype != want.dtype ||
          entry->shape != want.shape) {
        report.problems.push_back(fmt::format(
            "tensor {} in {}: header says {} [{}] at [{}, {}), manifest says {} [{}] at [{}, {})",
            want.name, path, entry->dtype, fmt::join(entry->shape, ","), entry->begin, entry->end,
            want.dtype, fmt::join(want.shape, ","), want.begin, want.end));
        continue;
      }
      buffer.resize(entry->end - entry->begin);
      absl::Status s = (*reader)->ReadEntry(*entry, buffer.data(), want.checksum);
      if (!s.ok()) report.problems.push_back(Message(s));
      report.bytes_checked += buffer.size();
    }
  }
  return report;
}

}  // namespace ckpt::persist
