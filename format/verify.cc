#include "format/verify.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <vector>

#include "common/status.h"
#include "format/checksum.h"
#include "format/shard_reader.h"
#include "format/read_plan.h"

namespace ckpt::format {
namespace {

using format::Manifest;
using format::TensorEntry;

struct Expected {
  std::string name;
  uint64_t begin, end;
  std::string checksum;
  std::vector<std::string> chunk_checksums;
  std::string dtype;
  std::vector<int64_t> shape;
};

// What the manifest says each rank's file holds, by rank: its pieces, as the planner reads
// them in their saved placement (each one whole entry of the rank's own file), then its
// train state. One plan for every rank: the planner indexes each tensor's shards once.
absl::StatusOr<std::vector<std::vector<Expected>>> ExpectedEntries(const Manifest& manifest) {
  std::vector<std::vector<WantedTensor>> by_rank = SavedPieces(manifest);
  std::vector<WantedTensor> pieces;
  for (const auto& rank_pieces : by_rank) pieces.insert(pieces.end(), rank_pieces.begin(), rank_pieces.end());
  ReadPlanOptions options;
  options.max_runs = ~uint64_t{0};  // one run per piece here
  CKPT_ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(manifest, pieces, options));
  std::vector<std::vector<Expected>> out(std::max<size_t>(by_rank.size(), manifest.shards.size()));
  for (size_t i = 0; i < pieces.size(); ++i) {
    const TensorReadPlan& t = plan.tensors[i];
    const uint32_t rank = *pieces[i].from_rank;
    if (t.bytes == 0) {  // nothing to read: the manifest's empty entry, as it is
      const auto& shards = manifest.tensors.at(t.name).shards;
      auto s = std::find_if(shards.begin(), shards.end(), [&](const auto& s) { return s.rank == rank; });
      out[rank].push_back({t.name, s->begin, s->end, s->checksum, {}, pieces[i].dtype, pieces[i].shape});
      continue;
    }
    if (!t.whole_entry() || t.reads[0].rank != rank) {
      return absl::DataLossError(fmt::format("tensor {}: rank {}'s piece is not one entry of its file",
                                             t.name, rank));
    }
    const ShardRead& read = t.reads[0];
    out[rank].push_back({t.name, read.entry_begin, read.entry_end, read.checksum, read.chunk_checksums,
                         pieces[i].dtype, pieces[i].shape});
  }
  for (const format::ManifestShard& shard : manifest.shards) {
    for (const auto& [name, e] : shard.train_state) {
      out[shard.rank].push_back({format::TrainStateKey(name), e.begin, e.end, e.checksum, {}, "U8",
                                 {static_cast<int64_t>(e.end - e.begin)}});
    }
  }
  return out;
}

// A shard shorter than the manifest says: the data region ends the file, so the manifest's
// offsets tell which entries the missing bytes belong to.
void ReportTruncatedEntries(storage::Store& store, const std::string& path, uint64_t expected_bytes,
                            const std::vector<Expected>& entries, VerifyReport& report) {
  auto object = store.Open(path);
  if (!object.ok()) return;
  const std::optional<uint64_t> size = (*object)->size();
  if (*size >= expected_bytes) return;
  uint64_t data_bytes = 0;
  for (const Expected& e : entries) data_bytes = std::max(data_bytes, e.end);
  uint64_t data_start = expected_bytes - data_bytes;
  uint64_t available = *size > data_start ? *size - data_start : 0;
  for (const Expected& e : entries) {
    if (e.end > available) {
      report.problems.push_back(fmt::format(
          "tensor {} in {}: truncated ({} of its {} bytes missing)", e.name, store.Describe(path),
          e.end - std::max(e.begin, std::min(available, e.end)), e.end - e.begin));
    }
  }
}

// Counts the bytes checked against those to check, and tells VerifyOptions::progress.
class ProgressCounter {
 public:
  ProgressCounter(const VerifyOptions& options, uint64_t total) : options_(options), total_(total) {}
  // False once the caller has asked to stop.
  bool Add(uint64_t bytes) {
    checked_ += bytes;
    if (options_.progress && !options_.progress(checked_, total_)) stopped_ = true;
    return !stopped_;
  }
  bool stopped() const { return stopped_; }

 private:
  const VerifyOptions& options_;
  const uint64_t total_;
  uint64_t checked_ = 0;
  bool stopped_ = false;
};

// Reads one entry in windows, checking its chunks as they come (ReadRange) and the whole
// entry's checksum at the end: a manifest whose chunk and whole checksums disagree is found
// too.
void CheckEntry(const format::ShardReader& reader, const TensorEntry& entry, const Expected& want,
                uint64_t chunk_bytes, ProgressCounter& progress, VerifyReport& report) {
  format::Checksum whole;
  const std::vector<std::string> no_chunks;
  const bool chunked = !want.chunk_checksums.empty();
  absl::Status read = reader.ReadRange(
      entry, {want.checksum, chunked ? want.chunk_checksums : no_chunks, chunked ? chunk_bytes : 0}, 0,
      entry.end - entry.begin, [&](uint64_t, const char* data, uint64_t bytes) {
        whole.Update(data, bytes);
        progress.Add(bytes);  // a stop takes effect after this entry: ReadRange cannot be stopped
      });
  if (!read.ok()) {
    report.problems.push_back(Message(read));
    return;
  }
  if (chunked && whole.Finish() != want.checksum) {
    report.problems.push_back(fmt::format(
        "tensor {} in {}: its chunks match their checksums but the whole entry does not match {} "
        "(the manifest disagrees with itself)",
        want.name, reader.path(), want.checksum));
  }
  report.bytes_checked += entry.end - entry.begin;
}

}  // namespace

absl::StatusOr<VerifyReport> VerifyCheckpoint(format::CheckpointStore& store, const std::string& job,
                                              uint64_t step, const VerifyOptions& options) {
  CKPT_ASSIGN_OR_RETURN(Manifest manifest, store.LoadManifest(job, step));
  VerifyReport report;
  const std::string dir = format::CheckpointStore::StepKey(job, step);  // a key of store.objects()
  const std::string dir_name = store.StepDir(job, step);             // what messages call it
  std::set<std::string> known = {"manifest.json"};
  for (const format::ManifestShard& shard : manifest.shards) known.insert(shard.file);
  // An indexed step's parts are its files too (each checked against the index when joined).
  if (auto index = store.LoadManifest(job, step, format::CheckpointStore::Depth::kIndexOnly); index.ok() && index->index) {
    for (const format::ManifestPart& part : index->index->parts) known.insert(part.file);
  }
  if (absl::StatusOr<std::vector<storage::ListEntry>> files = store.objects().List(dir); files.ok()) {
    for (const storage::ListEntry& file : *files) {
      if (!known.count(file.name)) {
        report.problems.push_back(fmt::format("{}/{}: a file the manifest does not list", dir_name, file.name));
      }
    }
  } else {
    report.problems.push_back(Message(files.status()));
  }
  absl::StatusOr<std::vector<std::vector<Expected>>> by_rank = ExpectedEntries(manifest);
  if (!by_rank.ok()) {
    // The manifest's placements cannot be read as they are (parsing checks them, so only a
    // manifest from a future format gets here): nothing can be compared with it.
    report.problems.push_back(fmt::format("{}/manifest.json: {}", dir_name, Message(by_rank.status())));
    return report;
  }
  auto here = [&](uint32_t rank) {
    std::optional<uint32_t> holder = manifest.NodeOf(rank);
    return !options.node || !holder || *holder == *options.node;
  };
  uint64_t total = 0;
  for (const format::ManifestShard& shard : manifest.shards) {
    if (!here(shard.rank)) continue;
    for (const Expected& want : by_rank->at(shard.rank)) total += want.end - want.begin;
  }
  ProgressCounter progress(options, total);
  // A node-scoped manifest lists its node's ranks alone: every other one is another node's,
  // as with `options.node`.
  if (manifest.scope) {
    for (uint32_t rank = 0; rank < manifest.world_size; ++rank) {
      if (manifest.Shard(rank) == nullptr) report.skipped_ranks.push_back(rank);
    }
  }
  for (const format::ManifestShard& shard : manifest.shards) {
    if (progress.stopped()) break;
    if (!here(shard.rank)) {
      report.skipped_ranks.push_back(shard.rank);
      continue;
    }
    const std::string key = dir + "/" + shard.file;
    const std::string path = store.objects().Describe(key);
    const std::vector<Expected>* expected = &by_rank->at(shard.rank);
    if (absl::StatusOr<bool> there = store.objects().Exists(key); !there.ok() || !*there) {
      report.problems.push_back(fmt::format("{}: missing (rank {}'s shard)", path, shard.rank));
      continue;
    }
    auto reader = format::ShardReader::Open(store.objects(), key, shard.bytes);
    if (!reader.ok()) {
      report.problems.push_back(Message(reader.status()));
      ReportTruncatedEntries(store.objects(), key, shard.bytes, *expected, report);
      continue;
    }
    std::set<std::string> listed;
    for (const Expected& want : *expected) {
      if (progress.stopped()) break;
      listed.insert(want.name);
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
      CheckEntry(**reader, *entry, want, manifest.checksum_chunk_bytes, progress, report);
    }
    if (progress.stopped()) continue;  // the entries not yet read are not "extra"
    for (const TensorEntry& entry : (*reader)->header().tensors) {
      if (!listed.count(entry.name)) {
        report.problems.push_back(fmt::format("tensor {} in {}: in the file but not in the manifest",
                                              entry.name, path));
      }
    }
  }
  std::sort(report.skipped_ranks.begin(), report.skipped_ranks.end());
  report.cancelled = progress.stopped();
  return report;
}

}  // namespace ckpt::format
