#include "format/verify.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <vector>

#include "common/status.h"
#include "format/checksum.h"
#include "format/plan_reader.h"
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
  uint64_t chunk_bytes = 0;  // of chunk_checksums
  // A delta entry of a version 5 piece (its bytes are checked with the piece's extents):
  // its header is compared, in size rather than shape, and it is not read here.
  bool delta = false;
};

// A version 5 piece with extents: read through them, in order, from this step's file and
// its origins', every chunk and the whole piece checked.
struct ExtentPiece {
  std::string name;
  ShardRead read;
};

struct Expectations {
  std::vector<std::vector<Expected>> entries;        // by rank: what its own file holds
  std::vector<std::vector<ExtentPiece>> extent_pieces;  // by rank
};

// What the manifest says each rank's file holds, by rank: its pieces, as the planner reads
// them in their saved placement (each one whole entry of the rank's own file), then its
// train state. One plan for every rank: the planner indexes each tensor's shards once.
absl::StatusOr<Expectations> ExpectedEntries(const Manifest& manifest) {
  std::vector<std::vector<WantedTensor>> by_rank = SavedPieces(manifest);
  std::vector<WantedTensor> pieces;
  for (const auto& rank_pieces : by_rank) pieces.insert(pieces.end(), rank_pieces.begin(), rank_pieces.end());
  ReadPlanOptions options;
  options.max_runs = ~uint64_t{0};  // one run per piece here
  CKPT_ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(manifest, pieces, options));
  const size_t ranks = std::max<size_t>(by_rank.size(), manifest.shards.size());
  Expectations expectations{std::vector<std::vector<Expected>>(ranks), std::vector<std::vector<ExtentPiece>>(ranks)};
  std::vector<std::vector<Expected>>& out = expectations.entries;
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
    if (read.extents.empty()) {
      out[rank].push_back({t.name, read.entry_begin, read.entry_end, read.checksum, read.chunk_checksums,
                           pieces[i].dtype, pieces[i].shape, read.chunk_bytes});
      continue;
    }
    for (const Extent& e : read.extents) {
      if (e.step) continue;
      const auto [lo, hi] = ChunkSpan(t.bytes, read.chunk_bytes, e.chunk_begin, e.chunk_end);
      out[rank].push_back({DeltaEntryName(t.name, e.chunk_begin, e.chunk_end), e.at, e.at + (hi - lo), {}, {},
                           pieces[i].dtype, {}, 0, /*delta=*/true});
    }
    expectations.extent_pieces[rank].push_back({t.name, read});
  }
  for (const format::ManifestShard& shard : manifest.shards) {
    for (const auto& [name, e] : shard.train_state) {
      if (e.step) continue;  // in an origin's file: CheckReferencedState
      out[shard.rank].push_back({format::TrainStateKey(name), e.begin, e.end, e.checksum, {}, "U8",
                                 {static_cast<int64_t>(e.end - e.begin)}});
    }
  }
  return expectations;
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

// The origins' files a version 5 step reads from, each opened once (and named in the report).
class OriginFiles {
 public:
  OriginFiles(storage::Store& store, const std::string& dir, const Manifest& manifest, VerifyReport& report)
      : store_(store), dir_(dir), manifest_(manifest), report_(report) {}

  absl::StatusOr<const ShardReader*> Get(uint64_t step, uint32_t rank) {
    auto [it, first] = readers_.try_emplace({step, rank});
    if (first) {
      absl::StatusOr<ShardReaderPtr> opened = OpenOriginFile(store_, dir_, manifest_, step, rank);
      if (opened.ok()) {
        report_.referenced_files.push_back((*opened)->path());
        it->second = *std::move(opened);
      } else {
        it->second = opened.status();
      }
    }
    if (!it->second.ok()) return it->second.status();
    return it->second->get();
  }

 private:
  storage::Store& store_;
  const std::string& dir_;
  const Manifest& manifest_;
  VerifyReport& report_;
  std::map<std::pair<uint64_t, uint32_t>, absl::StatusOr<ShardReaderPtr>> readers_;
};

// Reads a version 5 piece through its extents in order, from `own` (the rank's file) and the
// origins' files, checking each chunk as it comes and the whole piece at the end.
void CheckExtentPiece(const ShardReader& own, OriginFiles& origins, const ExtentPiece& piece,
                      ProgressCounter& progress, VerifyReport& report) {
  const ShardRead& read = piece.read;
  format::Checksum whole;
  for (const Extent& e : read.extents) {
    absl::StatusOr<const ShardReader*> reader = e.step ? origins.Get(*e.step, read.rank) : &own;
    if (!reader.ok()) {
      report.problems.push_back(fmt::format("tensor {}: {}", piece.name, Message(reader.status())));
      return;
    }
    absl::StatusOr<ExtentSpan> span = LocateExtent(**reader, piece.name, read, e);
    if (!span.ok()) {
      report.problems.push_back(Message(span.status()));
      return;
    }
    absl::Status s = (*reader)->ReadRange(span->entry, span->checksums(read), 0, span->hi - span->lo,
                                          [&](uint64_t, const char* data, uint64_t bytes) {
                                            whole.Update(data, bytes);
                                            progress.Add(bytes);
                                          });
    if (!s.ok()) {
      report.problems.push_back(Message(s));
      return;
    }
    if (e.step) report.bytes_referenced += span->hi - span->lo;
  }
  if (whole.Finish() != read.checksum) {
    report.problems.push_back(fmt::format(
        "tensor {} of rank {}: its chunks match their checksums but the whole piece does not match {} (the "
        "manifest disagrees with itself)",
        piece.name, read.rank, read.checksum));
  }
  report.bytes_checked += read.entry_end - read.entry_begin;
}

// The train-state blobs of `shard` that are entries of its origins' files.
void CheckReferencedState(const format::ManifestShard& shard, OriginFiles& origins, ProgressCounter& progress,
                          VerifyReport& report) {
  for (const auto& [name, e] : shard.train_state) {
    if (!e.step) continue;
    absl::StatusOr<const ShardReader*> reader = origins.Get(*e.step, shard.rank);
    if (!reader.ok()) {
      report.problems.push_back(fmt::format("train state {}: {}", name, Message(reader.status())));
      continue;
    }
    const TensorEntry* entry = (*reader)->Find(format::TrainStateKey(name));
    if (entry == nullptr || entry->begin != e.begin || entry->end != e.end || entry->dtype != "U8") {
      report.problems.push_back(fmt::format("train state {} of rank {}: not the U8 entry at [{}, {}) of {}", name,
                                            shard.rank, e.begin, e.end, (*reader)->path()));
      continue;
    }
    std::string data(e.end - e.begin, '\0');
    if (absl::Status s = (*reader)->ReadEntry(*entry, data.data(), e.checksum); !s.ok()) {
      report.problems.push_back(Message(s));
      continue;
    }
    progress.Add(data.size());
    report.bytes_checked += data.size();
    report.bytes_referenced += data.size();
  }
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
      // A group node's record of what it prepared, left by a crash just after the commit,
      // is not part of the step (ckptd removes it at its next start).
      if (!known.count(file.name) && !format::CheckpointStore::IsPreparedRecord(file.name)) {
        report.problems.push_back(fmt::format("{}/{}: a file the manifest does not list", dir_name, file.name));
      }
    }
  } else {
    report.problems.push_back(Message(files.status()));
  }
  absl::StatusOr<Expectations> by_rank = ExpectedEntries(manifest);
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
    for (const Expected& want : by_rank->entries.at(shard.rank)) {
      if (!want.delta) total += want.end - want.begin;
    }
    for (const ExtentPiece& piece : by_rank->extent_pieces.at(shard.rank)) {
      total += piece.read.entry_end - piece.read.entry_begin;
    }
    for (const auto& [name, e] : shard.train_state) {
      if (e.step) total += e.end - e.begin;
    }
  }
  OriginFiles origins(store.objects(), dir, manifest, report);
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
    const std::vector<Expected>* expected = &by_rank->entries.at(shard.rank);
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
          (!want.delta && entry->shape != want.shape)) {
        report.problems.push_back(fmt::format(
            "tensor {} in {}: header says {} [{}] at [{}, {}), manifest says {} [{}] at [{}, {})",
            want.name, path, entry->dtype, fmt::join(entry->shape, ","), entry->begin, entry->end,
            want.dtype, fmt::join(want.shape, ","), want.begin, want.end));
        continue;
      }
      if (!want.delta) CheckEntry(**reader, *entry, want, want.chunk_bytes, progress, report);
    }
    for (const ExtentPiece& piece : by_rank->extent_pieces.at(shard.rank)) {
      if (progress.stopped()) break;
      CheckExtentPiece(**reader, origins, piece, progress, report);
    }
    CheckReferencedState(shard, origins, progress, report);
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
