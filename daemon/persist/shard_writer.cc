#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "common/status.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "daemon/persist/run_appender.h"
#include "daemon/persist/shard_writer.h"

namespace ckpt::persist {
namespace {

constexpr uint64_t kBlock = 4096;              // O_DIRECT alignment; staging blocks match it

// Checksums each entry of a shard's data region as the writer's position moves through it,
// so that a large tensor is hashed chunk by chunk as it lands rather than in one pass first:
// the whole entry, and each kChecksumChunkBytes of an entry longer than that.
class RunningChecksums {
 public:
  explicit RunningChecksums(const StagedShard& shard, WrittenShard& out) : shard_(shard), out_(out) {}

  // Hashes bytes [position, upto) of the data region.
  void AdvanceTo(uint64_t upto) {
    while (next_ < shard_.entries.size()) {
      const format::TensorEntry& e = shard_.entries[next_];
      const bool chunked = format::ChecksumChunks(e.end - e.begin, format::kChecksumChunkBytes) != 0;
      position_ = std::max(position_, e.begin);
      while (position_ < std::min(upto, e.end)) {
        // Up to the next chunk boundary of the entry (its own offsets, not the file's).
        uint64_t boundary = e.begin + ((position_ - e.begin) / format::kChecksumChunkBytes + 1) * format::kChecksumChunkBytes;
        uint64_t stop = std::min({upto, e.end, boundary});
        const char* at = shard_.Data(e) + (position_ - e.begin);
        whole_.Update(at, stop - position_);
        if (chunked) chunk_.Update(at, stop - position_);
        position_ = stop;
        if (chunked && (stop == boundary || stop == e.end)) {
          out_.chunk_checksums[e.name].push_back(chunk_.Finish());
          chunk_.Reset();
        }
      }
      if (position_ < e.end) return;  // the rest of this entry has not been reached yet
      out_.checksums[e.name] = whole_.Finish();
      whole_.Reset();
      ++next_;
    }
  }

 private:
  const StagedShard& shard_;
  WrittenShard& out_;
  format::Checksum whole_;
  format::Checksum chunk_;
  size_t next_ = 0;
  uint64_t position_ = 0;
};

// Writes a shard as one object of the store: the header, then the data region in chunks as
// each lands, straight from staging memory. On a local disk that is O_DIRECT (no copy into
// the page cache, which profiling showed took most of the daemon's CPU, competing with the
// next rank's staging copy, and no eviction of the trainer's own cached data; storage/
// local_store.h); on S3 each chunk goes into the multipart upload.
class StoreShardWriter final : public ShardWriter {
 public:
  StoreShardWriter(storage::StorePtr store, std::function<void()> between_chunks)
      : store_(std::move(store)), between_chunks_(std::move(between_chunks)) {}

  absl::StatusOr<WrittenShard> Write(const StagedShard& shard, const std::string& dir) override {
    if (shard.region.size() != shard.data_bytes) {
      return absl::InternalError(fmt::format("rank {}'s staged region holds {} bytes, not the {} of its data region",
                                             shard.rank, shard.region.size(), shard.data_bytes));
    }
    WrittenShard out;
    out.file = format::ShardFileName(shard.rank);
    // Padded to a block: the data region then starts aligned, and goes out from the
    // caller's memory as it is.
    const std::string header = format::EncodeHeader(shard.entries, shard.metadata, kBlock);
    CKPT_RETURN_IF_ERROR(format::CheckHeaderFits(header, shard.entries.size(), store_->Describe(dir + "/" + out.file)));
    RunningChecksums checksums(shard, out);
    const std::string key = dir + "/" + out.file;
    absl::Status written = [&]() -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(std::unique_ptr<storage::ObjectWriter> object, store_->Create(key));
      CKPT_RETURN_IF_ERROR(object->Append(header.data(), header.size()));
      for (uint64_t off = 0; off < shard.data_bytes; off += kRunWriteBytes) {
        const uint64_t n = std::min(kRunWriteBytes, shard.data_bytes - off);
        CKPT_RETURN_IF_ERROR(Landed(shard, checksums, off + n));
        // A window that crosses from one span of the region to the next (a snapshot's own
        // bytes to its frozen block) goes out as one append per span.
        absl::Status appended;
        shard.region.ForEach(off, n, [&](const char* at, uint64_t len) {
          if (appended.ok()) appended = object->Append(at, len);
        });
        CKPT_RETURN_IF_ERROR(appended);
      }
      CKPT_RETURN_IF_ERROR(Landed(shard, checksums, shard.data_bytes));  // empty entries at the end
      CKPT_ASSIGN_OR_RETURN(out.bytes, object->Finish());
      return absl::OkStatus();
    }();
    if (!written.ok()) {
      // Named once, whatever failed: a store's own errors already name the object.
      const std::string where = store_->Describe(key);
      return Message(written).find(where) == std::string::npos ? Annotate(written, where) : written;
    }
    return out;
  }

 private:
  // Returns once [0, end) of the data region has landed, and checksums it.
  absl::Status Landed(const StagedShard& shard, RunningChecksums& checksums, uint64_t end) {
    if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(end));
    if (between_chunks_) between_chunks_();
    checksums.AdvanceTo(end);
    return absl::OkStatus();
  }

  storage::StorePtr store_;
  std::function<void()> between_chunks_;
};

}  // namespace


ShardWriterPtr MakeShardWriter(storage::StorePtr store, std::function<void()> between_chunks) {
  return std::make_unique<StoreShardWriter>(std::move(store), std::move(between_chunks));
}

}  // namespace ckpt::persist
