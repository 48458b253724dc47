// Reads entries of a committed shard back, checking each against its manifest checksum.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/filesystem.h"
#include "daemon/persist/safetensors.h"

namespace ckpt::persist {

class ShardReader {
 public:
  // Opens `path`, checks its size against `expected_bytes` (from the manifest) and parses
  // and validates its safetensors header.
  static absl::StatusOr<std::unique_ptr<ShardReader>> Open(Filesystem& fs, const std::string& path,
                                                           uint64_t expected_bytes);

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  const TensorEntry* Find(const std::string& name) const;

  // Reads `entry` into dst[0, entry size) and checks it against `expected_checksum`:
  // DataLoss naming the tensor and file on mismatch.
  absl::Status ReadEntry(const TensorEntry& entry, void* dst,
                         const std::string& expected_checksum) const;

 private:
  ShardReader(Filesystem& fs, std::string path, UniqueFd fd, SafetensorsHeader header)
      : fs_(fs), path_(std::move(path)), fd_(std::move(fd)), header_(std::move(header)) {}

  Filesystem& fs_;
  std::string path_;
  UniqueFd fd_;
  SafetensorsHeader header_;
};

using ShardReaderPtr = std::unique_ptr<ShardReader>;

}  // namespace ckpt::persist
