#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "common/status.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "daemon/persist/shard_writer.h"

namespace ckpt::persist {
namespace {

constexpr uint64_t kBlock = 4096;              // O_DIRECT alignment; staging blocks match it
constexpr uint64_t kWriteChunk = 32u << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

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
        whole_.Update(shard_.data + position_, stop - position_);
        if (chunked) chunk_.Update(shard_.data + position_, stop - position_);
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

// Writes shards straight from staging memory with O_DIRECT: no copy into the page cache
// (which profiling showed took most of the daemon's CPU, competing with the next rank's
// staging copy) and no eviction of the trainer's own cached data. Where the filesystem
// refuses O_DIRECT, buffered writes and a page-cache drop after fsync do the same job.
// Either way the data region goes out in chunks as soon as each has landed.
class LocalFsShardWriter final : public ShardWriter {
 public:
  LocalFsShardWriter(FilesystemPtr fs, std::function<void()> between_chunks)
      : fs_(std::move(fs)), between_chunks_(std::move(between_chunks)) {}

  absl::StatusOr<WrittenShard> Write(const StagedShard& shard, const std::string& dir) override {
    WrittenShard out;
    out.file = format::ShardFileName(shard.rank);
    const std::string path = dir + "/" + out.file;
    const std::string header = format::EncodeHeader(shard.entries, shard.metadata, kBlock);
    RunningChecksums checksums(shard, out);
    Chunks chunks{shard, checksums, between_chunks_};
    bool aligned = reinterpret_cast<uintptr_t>(shard.data) % kBlock == 0;
    auto direct = aligned ? fs_->CreateFileDirect(path) : absl::InvalidArgumentError("unaligned");
    if (direct.ok()) {
      CKPT_RETURN_IF_ERROR(Annotate(WriteDirect(direct->get(), header, chunks), path));
      CKPT_RETURN_IF_ERROR(Annotate(fs_->SyncFile(direct->get()), path));
    } else {
      CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_->CreateFile(path));
      CKPT_RETURN_IF_ERROR(Annotate(WriteBuffered(fd.get(), header, chunks), path));
      CKPT_RETURN_IF_ERROR(Annotate(fs_->SyncFile(fd.get()), path));
      fs_->DropFromCache(fd.get());  // durable; never read back from the cache
    }
    out.bytes = header.size() + shard.data_bytes;
    return out;
  }

 private:
  // The data region, handed out in order: each Next(end) returns once [.., end) has landed
  // and been checksummed.
  struct Chunks {
    const StagedShard& shard;
    RunningChecksums& checksums;
    const std::function<void()>& between_chunks;

    absl::Status Next(uint64_t end) {
      if (shard.landed != nullptr) CKPT_RETURN_IF_ERROR(shard.landed->WaitFor(end));
      if (between_chunks) between_chunks();
      checksums.AdvanceTo(end);
      return absl::OkStatus();
    }
  };

  absl::Status WriteDirect(int fd, const std::string& header, Chunks& chunks) {
    const StagedShard& shard = chunks.shard;
    const uint64_t base = header.size();  // a multiple of kBlock
    std::unique_ptr<char, FreeDeleter> bounce(static_cast<char*>(std::aligned_alloc(kBlock, base)));
    std::memcpy(bounce.get(), header.data(), base);
    CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, bounce.get(), base, 0));
    const uint64_t body = shard.data_bytes / kBlock * kBlock;
    for (uint64_t off = 0; off < body; off += kWriteChunk) {
      const uint64_t n = std::min(kWriteChunk, body - off);
      CKPT_RETURN_IF_ERROR(chunks.Next(off + n));
      CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, shard.data + off, n, base + off));
    }
    CKPT_RETURN_IF_ERROR(chunks.Next(shard.data_bytes));  // the tail, and empty entries
    if (uint64_t tail = shard.data_bytes - body; tail > 0) {
      std::unique_ptr<char, FreeDeleter> last(static_cast<char*>(std::aligned_alloc(kBlock, kBlock)));
      std::memset(last.get(), 0, kBlock);
      std::memcpy(last.get(), shard.data + body, tail);
      CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, last.get(), kBlock, base + body));
      CKPT_RETURN_IF_ERROR(fs_->Truncate(fd, base + shard.data_bytes));
    }
    return absl::OkStatus();
  }

  absl::Status WriteBuffered(int fd, const std::string& header, Chunks& chunks) {
    const StagedShard& shard = chunks.shard;
    CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, header.data(), header.size(), 0));
    for (uint64_t off = 0; off < shard.data_bytes; off += kWriteChunk) {
      const uint64_t n = std::min(kWriteChunk, shard.data_bytes - off);
      CKPT_RETURN_IF_ERROR(chunks.Next(off + n));
      CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, shard.data + off, n, header.size() + off));
    }
    return chunks.Next(shard.data_bytes);  // empty entries at the end
  }

  FilesystemPtr fs_;
  std::function<void()> between_chunks_;
};

}  // namespace


ShardWriterPtr MakeLocalFsShardWriter(FilesystemPtr fs, std::function<void()> between_chunks) {
  return std::make_unique<LocalFsShardWriter>(std::move(fs), std::move(between_chunks));
}

}  // namespace ckpt::persist
