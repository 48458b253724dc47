#include <fmt/format.h>

#include <algorithm>

#include "common/status.h"
#include "daemon/persist/checksum.h"
#include "daemon/persist/shard_writer.h"

namespace ckpt::persist {
namespace {

// Large sequential writes straight from staging memory; the checksum of each entry is
// computed from the same bytes just before they go to the kernel, while they are hot in
// cache.
constexpr uint64_t kWriteChunk = 16u << 20;

class LocalFsShardWriter final : public ShardWriter {
 public:
  explicit LocalFsShardWriter(FilesystemPtr fs) : fs_(std::move(fs)) {}

  absl::StatusOr<WrittenShard> Write(const StagedShard& shard, const std::string& dir) override {
    WrittenShard out;
    out.file = ShardFileName(shard.rank);
    std::string path = dir + "/" + out.file;
    std::string header = EncodeHeader(shard.entries, shard.metadata);
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_->CreateFile(path));
    CKPT_RETURN_IF_ERROR(Annotate(fs_->WriteAt(fd.get(), header.data(), header.size(), 0), path));
    uint64_t base = header.size();
    for (const TensorEntry& e : shard.entries) {
      Checksum sum;
      for (uint64_t off = e.begin; off < e.end; off += kWriteChunk) {
        uint64_t n = std::min(kWriteChunk, e.end - off);
        sum.Update(shard.data + off, n);
        CKPT_RETURN_IF_ERROR(
            Annotate(fs_->WriteAt(fd.get(), shard.data + off, n, base + off), path));
      }
      out.checksums[e.name] = sum.Finish();
    }
    CKPT_RETURN_IF_ERROR(Annotate(fs_->SyncFile(fd.get()), path));
    // Durable now, and never read back from the cache (hot restores use daemon memory):
    // keep checkpoints from crowding out the trainer's own page cache.
    fs_->DropFromCache(fd.get());
    out.bytes = base + shard.data_bytes;
    return out;
  }

 private:
  FilesystemPtr fs_;
};

}  // namespace

std::string ShardFileName(uint32_t rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

ShardWriterPtr MakeLocalFsShardWriter(FilesystemPtr fs) {
  return std::make_unique<LocalFsShardWriter>(std::move(fs));
}

}  // namespace ckpt::persist
