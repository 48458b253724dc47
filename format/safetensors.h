// The safetensors file format (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON (padded with spaces so that the data
// region starts 8-byte aligned), then a data region that the tensors cover exactly,
// without holes. Stock `safetensors` opens every file written here.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "storage/store.h"

namespace ckpt::format {

struct TensorEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets within the data region
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data region (8 + N)
  uint64_t data_bytes = 0;
};

// The 8-byte prefix plus the JSON header for `tensors` (which must be contiguous), padded
// with spaces so that the data region starts at a multiple of `alignment` (at least 8, as
// safetensors wants; ckptd uses 4096 so that shards can be written with O_DIRECT).
std::string EncodeHeader(const std::vector<TensorEntry>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         size_t alignment = 8);

// The largest JSON header stock readers open (safetensors' MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxWrittenHeaderBytes = 100'000'000;
// Ok when an EncodeHeader() result is within kMaxWrittenHeaderBytes; otherwise an error
// naming `file`, the header's size and its entry count: a file with a larger header would
// be written, committed, and then refused by every reader.
absl::Status CheckHeaderFits(const std::string& encoded, size_t entries, const std::string& file,
                             uint64_t limit = kMaxWrittenHeaderBytes);

// Reads and validates the header of the open file `path` of `file_size` bytes: JSON shape,
// known dtypes, sizes matching shapes, contiguous offsets covering the data region, and a
// file that is neither truncated nor extended.
absl::StatusOr<SafetensorsHeader> ReadHeader(const storage::ObjectReader& object);

}  // namespace ckpt::format
