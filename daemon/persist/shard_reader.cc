#include "daemon/persist/shard_reader.h"

#include <fmt/format.h>

#include "common/status.h"
#include "daemon/persist/checksum.h"

namespace ckpt::persist {

absl::StatusOr<ShardReaderPtr> ShardReader::Open(Filesystem& fs, const std::string& path,
                                                 uint64_t expected_bytes) {
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs.FileSize(path));
  if (size != expected_bytes) {
    return absl::DataLossError(fmt::format("{}: {} bytes on disk, manifest says {} ({})", path,
                                           size, expected_bytes,
                                           size < expected_bytes ? "truncated" : "extended"));
  }
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs.OpenForRead(path));
  CKPT_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadHeader(fs, fd.get(), size, path));
  return ShardReaderPtr(new ShardReader(fs, path, std::move(fd), std::move(header)));
}

const TensorEntry* ShardReader::Find(const std::string& name) const {
  for (const TensorEntry& e : header_.tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::Status ShardReader::ReadEntry(const TensorEntry& entry, void* dst,
                                    const std::string& expected_checksum) const {
  CKPT_RETURN_IF_ERROR(Annotate(
      fs_.ReadAt(fd_.get(), dst, entry.end - entry.begin, header_.data_start + entry.begin),
      fmt::format("{} tensor {}", path_, entry.name)));
  std::string actual = ChecksumOf(dst, entry.end - entry.begin);
  if (actual != expected_checksum) {
    return absl::DataLossError(fmt::format("tensor {} in {}: checksum mismatch (manifest {}, file {})",
                                           entry.name, path_, expected_checksum, actual));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::persist
