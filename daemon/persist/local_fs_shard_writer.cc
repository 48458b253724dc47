#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/status.h"
#include "daemon/persist/checksum.h"
#include "daemon/persist/shard_writer.h"

namespace ckpt::persist {
namespace {

constexpr uint64_t kBlock = 4096;              // O_DIRECT alignment; staging blocks match it
constexpr uint64_t kWriteChunk = 32u << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Writes shards straight from staging memory with O_DIRECT: no copy into the page cache
// (which profiling showed took most of the daemon's CPU, competing with the next rank's
// staging copy) and no eviction of the trainer's own cached data. Where the filesystem
// refuses O_DIRECT, buffered writes and a page-cache drop after fsync do the same job.
class LocalFsShardWriter final : public ShardWriter {
 public:
  LocalFsShardWriter(FilesystemPtr fs, std::function<void()> between_chunks)
      : fs_(std::move(fs)), between_chunks_(std::move(between_chunks)) {}

  absl::StatusOr<WrittenShard> Write(const StagedShard& shard, const std::string& dir) override {
    WrittenShard out;
    out.file = ShardFileName(shard.rank);
    const std::string path = dir + "/" + out.file;
    const std::string header = EncodeHeader(shard.entries, shard.metadata, kBlock);
    const uint64_t base = header.size();
    for (const TensorEntry& e : shard.entries) {
      if (between_chunks_) between_chunks_();
      out.checksums[e.name] = ChecksumOf(shard.data + e.begin, e.end - e.begin);
    }
    bool aligned = reinterpret_cast<uintptr_t>(shard.data) % kBlock == 0;
    auto direct = aligned ? fs_->CreateFileDirect(path) : absl::InvalidArgumentError("unaligned");
    if (direct.ok()) {
      CKPT_RETURN_IF_ERROR(Annotate(WriteDirect(direct->get(), header, shard), path));
      CKPT_RETURN_IF_ERROR(Annotate(fs_->SyncFile(direct->get()), path));
    } else {
      CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_->CreateFile(path));
      CKPT_RETURN_IF_ERROR(Annotate(WriteBuffered(fd.get(), header, shard), path));
      CKPT_RETURN_IF_ERROR(Annotate(fs_->SyncFile(fd.get()), path));
      fs_->DropFromCache(fd.get());  // durable; never read back from the cache
    }
    out.bytes = base + shard.data_bytes;
    return out;
  }

 private:
  absl::Status WriteDirect(int fd, const std::string& header, const StagedShard& shard) {
    const uint64_t base = header.size();  // a multiple of kBlock
    std::unique_ptr<char, FreeDeleter> bounce(static_cast<char*>(std::aligned_alloc(kBlock, base)));
    std::memcpy(bounce.get(), header.data(), base);
    CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, bounce.get(), base, 0));
    const uint64_t body = shard.data_bytes / kBlock * kBlock;
    for (uint64_t off = 0; off < body; off += kWriteChunk) {
      if (between_chunks_) between_chunks_();
      CKPT_RETURN_IF_ERROR(
          fs_->WriteAt(fd, shard.data + off, std::min(kWriteChunk, body - off), base + off));
    }
    if (uint64_t tail = shard.data_bytes - body; tail > 0) {
      std::unique_ptr<char, FreeDeleter> last(static_cast<char*>(std::aligned_alloc(kBlock, kBlock)));
      std::memset(last.get(), 0, kBlock);
      std::memcpy(last.get(), shard.data + body, tail);
      CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, last.get(), kBlock, base + body));
      CKPT_RETURN_IF_ERROR(fs_->Truncate(fd, base + shard.data_bytes));
    }
    return absl::OkStatus();
  }

  absl::Status WriteBuffered(int fd, const std::string& header, const StagedShard& shard) {
    CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, header.data(), header.size(), 0));
    for (uint64_t off = 0; off < shard.data_bytes; off += kWriteChunk) {
      if (between_chunks_) between_chunks_();
      CKPT_RETURN_IF_ERROR(fs_->WriteAt(fd, shard.data + off,
                                        std::min(kWriteChunk, shard.data_bytes - off),
                                        header.size() + off));
    }
    return absl::OkStatus();
  }

  FilesystemPtr fs_;
  std::function<void()> between_chunks_;
};

}  // namespace

std::string ShardFileName(uint32_t rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

ShardWriterPtr MakeLocalFsShardWriter(FilesystemPtr fs, std::function<void()> between_chunks) {
  return std::make_unique<LocalFsShardWriter>(std::move(fs), std::move(between_chunks));
}

}  // namespace ckpt::persist
