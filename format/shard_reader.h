// Reads entries of a committed shard back, checking each against its manifest checksum.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/store.h"
#include "format/safetensors.h"

namespace ckpt::format {

class ShardReader {
 public:
  // Opens `path`, checks its size against `expected_bytes` (from the manifest) and parses
  // and validates its safetensors header.
  static absl::StatusOr<std::unique_ptr<ShardReader>> Open(storage::Store& store,
                                                           const std::string& key,
                                                           uint64_t expected_bytes);

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  const TensorEntry* Find(const std::string& name) const;
  // The entry whose bytes hold all of [begin, end) of the data region, or nullptr (a range
  // across two entries, or outside every one): where a version 5 extent must lie.
  const TensorEntry* EntryCovering(uint64_t begin, uint64_t end) const;

  // Reads `entry` into dst[0, entry size) and checks it against `expected_checksum`:
  // DataLoss naming the tensor and file on mismatch.
  absl::Status ReadEntry(const TensorEntry& entry, void* dst,
                         const std::string& expected_checksum) const;

  // What an entry's bytes are checked against: the whole entry's checksum, and the
  // checksum of each `chunk_bytes` of it where the manifest records them.
  struct Checksums {
    const std::string& whole;
    const std::vector<std::string>& chunks;
    uint64_t chunk_bytes = 0;
  };
  // Receives verified bytes of an entry: `bytes` at `offset` within the entry.
  using RangeSink = std::function<void(uint64_t offset, const char* data, uint64_t bytes)>;
  // Reads bytes [from, to) of `entry` (offsets within it) and hands them to `sink` in
  // order, each piece checked before it is handed out: the chunks covering the range
  // against their checksums, or the whole entry when it has no chunks (entries of one
  // chunk or less, manifests from before chunks). Holds at most one window of
  // kReadWindowBytes (or one unchunked entry) in memory, whatever the range. Returns the
  // bytes read from the file (the covering chunks) through `read_bytes`.
  absl::Status ReadRange(const TensorEntry& entry, const Checksums& checksums, uint64_t from,
                         uint64_t to, const RangeSink& sink, uint64_t* read_bytes = nullptr) const;
  static constexpr uint64_t kReadWindowBytes = uint64_t{64} << 20;

 private:
  ShardReader(std::unique_ptr<storage::ObjectReader> object, SafetensorsHeader header);

  std::unique_ptr<storage::ObjectReader> object_;
  const std::string& path_;  // the object's name
  SafetensorsHeader header_;
  // Entry names to header_.tensors: a restore looks every one of its tensors up.
  std::unordered_map<std::string_view, const TensorEntry*> by_name_;
};

using ShardReaderPtr = std::unique_ptr<ShardReader>;

}  // namespace ckpt::format
