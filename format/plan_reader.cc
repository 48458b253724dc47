#include "format/plan_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "common/status.h"

namespace ckpt::format {
namespace {

// Copies the parts of `runs` (sorted by source) that fall in [offset, offset + bytes) of
// the saved entry from `data` into `dst`. `next` remembers where the last call stopped.
void Scatter(const std::vector<ByteRun>& runs, size_t& next, uint64_t offset, const char* data,
             uint64_t bytes, char* dst) {
  const uint64_t end = offset + bytes;
  while (next < runs.size() && runs[next].source + runs[next].bytes <= offset) ++next;
  for (size_t i = next; i < runs.size() && runs[i].source < end; ++i) {
    const ByteRun& run = runs[i];
    const uint64_t from = std::max(run.source, offset);
    const uint64_t to = std::min(run.source + run.bytes, end);
    std::memcpy(dst + run.destination + (from - run.source), data + (from - offset), to - from);
  }
}

// What the file's header says of an entry against what the manifest says: nothing when
// they agree (dtype, shape and data offsets), else the DataLoss naming both.
absl::Status CheckHeaderEntry(const std::string& what, const std::string& path, const TensorEntry* entry,
                              const std::string& dtype, const std::vector<int64_t>& shape, uint64_t begin,
                              uint64_t end) {
  if (entry == nullptr) return absl::DataLossError(fmt::format("{} is missing from {}", what, path));
  if (entry->dtype == dtype && entry->shape == shape && entry->begin == begin && entry->end == end) {
    return absl::OkStatus();
  }
  return absl::DataLossError(fmt::format(
      "{} in {}: the file's header disagrees with the manifest (header says {} [{}] at [{}, {}), manifest says {} "
      "[{}] at [{}, {}))",
      what, path, entry->dtype, fmt::join(entry->shape, ","), entry->begin, entry->end, dtype, fmt::join(shape, ","),
      begin, end));
}

}  // namespace

absl::Status Unreadable(const absl::Status& status) {
  if (status.ok() || absl::IsDataLoss(status) || absl::IsNotFound(status) || absl::IsResourceExhausted(status) ||
      absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status) || absl::IsCancelled(status) ||
      absl::IsAborted(status)) {
    return status;
  }
  return absl::DataLossError(fmt::format("cannot be read: {}", Message(status)));
}

const PlanReader::HotShard& PlanReader::Hot(uint32_t rank) {
  // After Open() every rank read is here: a lookup alone, safe on several threads.
  if (auto found = hot_shards_.find(rank); found != hot_shards_.end()) return found->second;
  HotShard& hot = hot_shards_[rank];
  if (hot_ && (hot.snapshot = hot_(rank))) {
    const auto& entries = *hot.snapshot->entries;
    for (size_t i = 0; i < hot.snapshot->tensor_count; ++i) {
      hot.tensors.emplace(entries[i].name, &entries[i]);
    }
  }
  return hot;
}

const char* PlanReader::InMemory(const TensorReadPlan& tensor, const ShardRead& read) {
  const HotShard& hot = Hot(read.rank);
  auto e = hot.tensors.find(tensor.name);
  if (e == hot.tensors.end()) return nullptr;
  // A version 5 file holds only the step's own bytes, laid out unlike the snapshot it was
  // written from: the piece is the snapshot's entry of its name and size.
  const bool same = manifest_.increment ? e->second->end - e->second->begin == read.entry_end - read.entry_begin
                                        : e->second->begin == read.entry_begin && e->second->end == read.entry_end;
  return same ? hot.snapshot->data->Contiguous(e->second->begin, e->second->end - e->second->begin) : nullptr;
}

absl::Status PlanReader::Open(const std::vector<TensorReadPlan>& tensors) {
  for (const TensorReadPlan& tensor : tensors) {
    for (const ShardRead& read : tensor.reads) {
      if (read.runs.empty() || InMemory(tensor, read) != nullptr) continue;
      if (read.extents.empty()) CKPT_RETURN_IF_ERROR(Reader(read.rank).status());
      for (const Extent& e : read.extents) CKPT_RETURN_IF_ERROR(ExtentReader(e.step, read.rank).status());
    }
  }
  return absl::OkStatus();
}

absl::Status PlanReader::HeldElsewhere(uint32_t rank) const {
  return absl::NotFoundError(fmt::format(
      "rank {}'s shard of step {} is held by another node: this is node {}'s manifest, which "
      "lists only its own ranks (a reader of other nodes' ranks needs node 0's manifest or the "
      "remote tier's, and their shard files)",
      rank, manifest_.step, manifest_.scope->node));
}

absl::StatusOr<const format::ShardReader*> PlanReader::Reader(uint32_t rank) {
  if (auto it = readers_.find(rank); it != readers_.end()) return it->second.get();
  const format::ManifestShard* listed = manifest_.Shard(rank);
  if (listed == nullptr && manifest_.scope && rank < manifest_.world_size) {
    return HeldElsewhere(rank);
  }
  if (listed == nullptr) {
    return absl::DataLossError(fmt::format("the manifest of step {} has no rank {}", manifest_.step, rank));
  }
  const format::ManifestShard& shard = *listed;
  const std::string path = step_dir_ + "/" + shard.file;
  // Opened without asking first whether it is there: over a store far away each question
  // is a round trip.
  absl::StatusOr<format::ShardReaderPtr> reader = format::ShardReader::Open(store_, path, shard.bytes);
  // Another file's in its place (a symlink, a directory, a FIFO), or one the disk fails
  // to read: damage, like bytes that fail their checksums.
  if (!reader.ok() && !absl::IsNotFound(reader.status())) {
    return Annotate(Unreadable(reader.status()), fmt::format("rank {}'s shard of step {}", rank, manifest_.step));
  }
  if (absl::IsNotFound(reader.status())) {
    return absl::NotFoundError(fmt::format(
        "{}: rank {}'s shard of step {} is neither in memory nor on this node's disk (a "
        "restore with another placement reads every saved shard it overlaps; across nodes "
        "they must share one --root): {}",
        store_.Describe(path), rank, manifest_.step, Message(reader.status())));
  }
  CKPT_RETURN_IF_ERROR(reader.status());
  return readers_.emplace(rank, *std::move(reader)).first->second.get();
}

absl::StatusOr<ShardReaderPtr> OpenOriginFile(storage::Store& store, const std::string& step_dir,
                                              const Manifest& manifest, uint64_t step, uint32_t rank) {
  const Origin* origin = manifest.increment ? manifest.increment->Find(step, rank) : nullptr;
  if (origin == nullptr) {  // ParseManifest checked every reference: only a caller's mistake
    return absl::DataLossError(fmt::format("step {} references step {} of rank {}, which it lists no file of",
                                           manifest.step, step, rank));
  }
  const size_t slash = step_dir.rfind('/');
  const std::string job_dir = slash == std::string::npos ? "" : step_dir.substr(0, slash + 1);
  std::vector<std::string> tried;
  for (const std::string& key : OriginFileKeys(*origin)) {
    absl::StatusOr<ShardReaderPtr> reader = ShardReader::Open(store, job_dir + key, origin->bytes);
    if (reader.ok()) return reader;
    if (!absl::IsNotFound(reader.status())) {
      return Annotate(Unreadable(reader.status()), fmt::format("rank {}'s file of step {}, which step {} references",
                                                               rank, step, manifest.step));
    }
    tried.push_back(store.Describe(job_dir + key));
  }
  // The bytes of a committed step are gone: damage, so a restore falls back to an older step.
  return absl::DataLossError(fmt::format("rank {}'s file of step {} (run {:016x}), which step {} references, is "
                                         "missing: not at {}",
                                         rank, step, origin->run, manifest.step, fmt::join(tried, " nor at ")));
}

absl::StatusOr<ExtentSpan> LocateExtent(const ShardReader& reader, const std::string& tensor, const ShardRead& read,
                                        const Extent& e) {
  const auto [lo, hi] = ChunkSpan(read.entry_end - read.entry_begin, read.chunk_bytes, e.chunk_begin, e.chunk_end);
  const std::string what =
      e.step ? fmt::format("tensor {} (its chunks [{}, {}), referenced in step {})", tensor, e.chunk_begin,
                           e.chunk_end, *e.step)
             : fmt::format("tensor {} (its chunks [{}, {}))", tensor, e.chunk_begin, e.chunk_end);
  const TensorEntry* holder = reader.EntryCovering(e.at, e.at + (hi - lo));
  if (holder == nullptr || holder->dtype != read.dtype || !EntryHoldsTensor(holder->name, tensor)) {
    return absl::DataLossError(fmt::format(
        "{} in {}: bytes [{}, {}) of the data region are not inside one {} entry of the tensor ({})", what,
        reader.path(), e.at, e.at + (hi - lo), read.dtype,
        holder == nullptr ? "no entry holds them all" : fmt::format("entry {} holds them", holder->name)));
  }
  ExtentSpan span{lo, hi, TensorEntry{what, read.dtype, {}, e.at, e.at + (hi - lo)}, {}};
  if (!read.chunk_checksums.empty()) {
    span.chunks.assign(read.chunk_checksums.begin() + e.chunk_begin, read.chunk_checksums.begin() + e.chunk_end);
  }
  return span;
}

absl::StatusOr<const format::ShardReader*> PlanReader::OriginReader(uint64_t step, uint32_t rank) {
  if (auto it = origin_readers_.find({step, rank}); it != origin_readers_.end()) return it->second.get();
  CKPT_ASSIGN_OR_RETURN(ShardReaderPtr reader, OpenOriginFile(store_, step_dir_, manifest_, step, rank));
  return origin_readers_.emplace(std::pair{step, rank}, std::move(reader)).first->second.get();
}

absl::StatusOr<const format::ShardReader*> PlanReader::ExtentReader(const std::optional<uint64_t>& step,
                                                                    uint32_t rank) {
  return step ? OriginReader(*step, rank) : Reader(rank);
}

absl::Status PlanReader::ReadExtents(const TensorReadPlan& tensor, const ShardRead& read, char* dst) {
  const uint64_t piece = read.entry_end - read.entry_begin;
  size_t next = 0;
  for (const Extent& e : read.extents) {
    const auto [lo, hi] = ChunkSpan(piece, read.chunk_bytes, e.chunk_begin, e.chunk_end);
    // The part of the extent that the runs want, if any: read whole chunks around it.
    uint64_t from = hi, to = lo;
    for (const ByteRun& run : read.runs) {
      const uint64_t a = std::max(run.source, lo), b = std::min(run.source + run.bytes, hi);
      if (a < b) from = std::min(from, a), to = std::max(to, b);
    }
    if (from >= to) continue;
    CKPT_ASSIGN_OR_RETURN(const format::ShardReader* reader, ExtentReader(e.step, read.rank));
    CKPT_ASSIGN_OR_RETURN(ExtentSpan span, LocateExtent(*reader, tensor.name, read, e));
    uint64_t fetched = 0;
    absl::Status s = reader->ReadRange(
        span.entry, span.checksums(read), from - lo, to - lo,
        [&](uint64_t offset, const char* data, uint64_t bytes) {
          Scatter(read.runs, next, lo + offset, data, bytes, dst);
        },
        &fetched);
    from_disk_ += fetched;
    CKPT_RETURN_IF_ERROR(Unreadable(s));
  }
  return absl::OkStatus();
}

absl::Status PlanReader::Read(const TensorReadPlan& tensor, char* dst) {
  for (const ShardRead& read : tensor.reads) {
    if (read.runs.empty()) continue;
    // ckptd's own copy of the committed step: the bytes the file was written from.
    if (const char* saved = InMemory(tensor, read)) {
      size_t next = 0;
      const uint64_t size = read.entry_end - read.entry_begin;
      Scatter(read.runs, next, 0, saved, size, dst);
      for (const ByteRun& run : read.runs) from_memory_ += run.bytes;
      continue;
    }
    if (!read.extents.empty()) {
      CKPT_RETURN_IF_ERROR(ReadExtents(tensor, read, dst));
      continue;
    }
    CKPT_ASSIGN_OR_RETURN(const format::ShardReader* reader, Reader(read.rank));
    const format::TensorEntry* entry = reader->Find(tensor.name);
    // Checked before a byte is used: bytes that match their checksums but that the header
    // calls another dtype or shape are not the tensor the manifest describes.
    CKPT_RETURN_IF_ERROR(CheckHeaderEntry("tensor " + tensor.name, reader->path(), entry, read.dtype, read.shape,
                                          read.entry_begin, read.entry_end));
    if (tensor.whole_entry()) {
      // The saved placement: one pread straight into place, no window to copy out of.
      CKPT_RETURN_IF_ERROR(Unreadable(reader->ReadEntry(*entry, dst, read.checksum)));
      from_disk_ += tensor.bytes;
      continue;
    }
    size_t next = 0;
    const uint64_t from = read.runs.front().source;
    const uint64_t to = read.runs.back().source + read.runs.back().bytes;
    uint64_t fetched = 0;
    absl::Status s = reader->ReadRange(
        *entry, {read.checksum, read.chunk_checksums, read.chunk_bytes}, from, to,
        [&](uint64_t offset, const char* data, uint64_t bytes) {
          Scatter(read.runs, next, offset, data, bytes, dst);
        },
        &fetched);
    from_disk_ += fetched;
    CKPT_RETURN_IF_ERROR(Unreadable(s));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedBytes>> PlanReader::TrainState(uint32_t rank) {
  std::vector<NamedBytes> state;
  if (const std::optional<MemoryShard>& snap = Hot(rank).snapshot) {
    for (size_t i = snap->tensor_count; i < snap->entries->size(); ++i) {
      const format::TensorEntry& e = (*snap->entries)[i];
      std::string bytes(e.end - e.begin, '\0');
      snap->data->CopyTo(e.begin, bytes.size(), bytes.data());
      state.push_back({(*snap->train_state_names)[i - snap->tensor_count], std::move(bytes)});
    }
    return state;
  }
  const format::ManifestShard* listed = manifest_.Shard(rank);
  if (listed == nullptr && manifest_.scope && rank < manifest_.world_size) return HeldElsewhere(rank);
  if (listed == nullptr) return state;  // a rank the step was not saved with: no state
  const auto& saved = listed->train_state;
  if (saved.empty()) return state;
  for (const auto& [name, e] : saved) {
    // A blob equal to an earlier step's is that step's entry (version 5).
    CKPT_ASSIGN_OR_RETURN(const format::ShardReader* reader, ExtentReader(e.step, rank));
    const format::TensorEntry* entry = reader->Find(format::TrainStateKey(name));
    CKPT_RETURN_IF_ERROR(CheckHeaderEntry("train state " + name, reader->path(), entry, "U8",
                                          {static_cast<int64_t>(e.end - e.begin)}, e.begin, e.end));
    std::string data(entry->end - entry->begin, '\0');
    CKPT_RETURN_IF_ERROR(Unreadable(reader->ReadEntry(*entry, data.data(), e.checksum)));
    from_disk_ += data.size();
    state.push_back({name, std::move(data)});
  }
  return state;
}

}  // namespace ckpt::format
