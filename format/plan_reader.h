// Carries out a read plan (read_plan.h) for one step: the bytes of each wanted piece, from
// memory where the caller holds the saved rank's shard (ckptd's own copy of what it wrote),
// from its shard file otherwise (pread of the chunks covering the plan's runs, never whole
// files), every byte read from a file checked against the manifest's checksums first.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/store.h"
#include "common/scattered_bytes.h"
#include "format/manifest.h"
#include "format/read_plan.h"
#include "format/shard_reader.h"

namespace ckpt::format {

// A saved rank's shard held in memory: its data region and entries, kept alive by `owner`.
struct MemoryShard {
  std::shared_ptr<const void> owner;
  const ScatteredBytes* data = nullptr;  // each entry lies whole in one of its spans
  const std::vector<TensorEntry>* entries = nullptr;  // tensors, then train-state blobs
  size_t tensor_count = 0;
  const std::vector<std::string>* train_state_names = nullptr;  // per blob entry
};

// A train-state blob as saved.
struct NamedBytes {
  std::string name;
  std::string data;
};

// A shard's read error as the restore takes it: DataLoss (the step is damaged, and an older
// one is restored instead) for a file that cannot be read (EIO, another kind of file or a
// symlink in its place); as it is for what says nothing of the file: NotFound (not held
// here), no memory, a store unreachable or timed out, a stop.
absl::Status Unreadable(const absl::Status& status);

// Opens rank `rank`'s file of step `step` that `manifest` (of the step at `step_dir` in
// `store`) references: in that step's directory, or, retired and held, in its held one
// (format::OriginFileKeys), checked against the size the manifest records. DataLoss naming
// both places when it is in neither (the bytes of a committed step are gone).
absl::StatusOr<ShardReaderPtr> OpenOriginFile(storage::Store& store, const std::string& step_dir,
                                              const Manifest& manifest, uint64_t step, uint32_t rank);

// One extent of a version 5 piece as it is read from its file: the bytes [lo, hi) of the
// piece, at `entry` (a span of the file named for messages), checked against `chunks` (the
// piece's checksums of those chunks; none for a piece of one chunk, checked whole).
struct ExtentSpan {
  uint64_t lo = 0;
  uint64_t hi = 0;
  TensorEntry entry;
  std::vector<std::string> chunks;
  ShardReader::Checksums checksums(const ShardRead& read) const {
    return {read.checksum, chunks, chunks.empty() ? 0 : read.chunk_bytes};
  }
};
// Where extent `e` of `read` (a piece of tensor `tensor`) is in `reader`'s file: DataLoss
// unless it lies inside one entry of the file that holds that tensor's bytes (its own name
// or a delta of it) in its dtype, so that no extent makes a reader take another tensor's
// bytes, or a header, for this one's.
absl::StatusOr<ExtentSpan> LocateExtent(const ShardReader& reader, const std::string& tensor, const ShardRead& read,
                                        const Extent& e);

class PlanReader {
 public:
  // The shard of a saved rank of this step held in memory, or nullopt.
  using HotLookup = std::function<std::optional<MemoryShard>(uint32_t rank)>;

  // `step` is the step's prefix in `store` (its directory, for a local store); a version 5
  // step's origins are in its siblings (format::OriginFileKeys).
  PlanReader(storage::Store& store, std::string step, const format::Manifest& manifest,
             HotLookup hot)
      : store_(store), step_dir_(std::move(step)), manifest_(manifest), hot_(std::move(hot)) {}

  // Looks up, and opens, everything `tensors` read from (each saved rank's memory copy or
  // file, once). After it, Read() of those tensors may run on several threads at once:
  // a store far away (the remote tier) answers many requests faster than one.
  absl::Status Open(const std::vector<TensorReadPlan>& tensors);

  // Fills dst[0, tensor.bytes) with the wanted piece. DataLoss when what was read does not
  // match its checksums, the file's header disagrees with the manifest (an entry's dtype,
  // shape or offsets: checked before its bytes are read) or the file cannot be read
  // (Unreadable); NotFound when a shard it
  // needs is neither in memory nor on this node's disk, or is held by another node (a
  // node-scoped manifest: Manifest::scope).
  absl::Status Read(const TensorReadPlan& tensor, char* dst);

  // Rank `rank`'s train state, checked the same way; none for a rank the step was not saved
  // with, NotFound for one that a node-scoped manifest leaves to another node.
  absl::StatusOr<std::vector<NamedBytes>> TrainState(uint32_t rank);

  uint64_t bytes_from_memory() const { return from_memory_; }
  // What was read from the store (a file, the remote tier), chunks whole.
  uint64_t bytes_from_disk() const { return from_disk_; }

 private:
  // A saved rank's snapshot in memory, its tensor entries by name.
  struct HotShard {
    std::optional<MemoryShard> snapshot;  // nullopt: not in memory
    std::unordered_map<std::string_view, const format::TensorEntry*> tensors;
  };
  // Looked up, and indexed, once per rank.
  const HotShard& Hot(uint32_t rank);
  // The bytes of `read`'s saved entry in ckptd's memory copy of its rank, or null.
  const char* InMemory(const TensorReadPlan& tensor, const ShardRead& read);
  absl::StatusOr<const format::ShardReader*> Reader(uint32_t rank);
  // Version 5: the file of step `step` that rank `rank` references (Increment::origins),
  // in that step's directory or, retired and held, in its held one; opened once.
  absl::StatusOr<const format::ShardReader*> OriginReader(uint64_t step, uint32_t rank);
  // The reader of an extent's file: the rank's own in this step, or its origin's.
  absl::StatusOr<const format::ShardReader*> ExtentReader(const std::optional<uint64_t>& step, uint32_t rank);
  // Reads a version 5 piece's runs through its extents, each chunk checked as it comes.
  absl::Status ReadExtents(const TensorReadPlan& tensor, const ShardRead& read, char* dst);
  // NotFound for a rank of the step that a node-scoped manifest leaves to another node.
  absl::Status HeldElsewhere(uint32_t rank) const;

  storage::Store& store_;
  const std::string step_dir_;
  const format::Manifest& manifest_;
  HotLookup hot_;
  std::map<uint32_t, HotShard> hot_shards_;
  std::map<uint32_t, format::ShardReaderPtr> readers_;      // opened once per file
  std::map<std::pair<uint64_t, uint32_t>, format::ShardReaderPtr> origin_readers_;  // by (step, rank)
  std::atomic<uint64_t> from_memory_ = 0;
  std::atomic<uint64_t> from_disk_ = 0;
};

}  // namespace ckpt::format
