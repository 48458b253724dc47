#include "format/shard_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <new>

#include "common/status.h"
#include "format/checksum.h"

namespace ckpt::format {

absl::StatusOr<ShardReaderPtr> ShardReader::Open(storage::Store& store, const std::string& key,
                                                 uint64_t expected_bytes) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<storage::ObjectReader> object, store.Open(key));
  const uint64_t size = object->size();
  const std::string& path = object->name();
  if (size != expected_bytes) {
    return absl::DataLossError(fmt::format("{}: {} bytes on disk, manifest says {} ({})", path,
                                           size, expected_bytes,
                                           size < expected_bytes ? "truncated" : "extended"));
  }
  CKPT_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadHeader(*object));
  return ShardReaderPtr(new ShardReader(std::move(object), std::move(header)));
}

ShardReader::ShardReader(std::unique_ptr<storage::ObjectReader> object, SafetensorsHeader header)
    : object_(std::move(object)), path_(object_->name()), header_(std::move(header)) {
  by_name_.reserve(header_.tensors.size());
  for (const TensorEntry& e : header_.tensors) by_name_.emplace(e.name, &e);  // first one wins
}

const TensorEntry* ShardReader::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorEntry* ShardReader::EntryCovering(uint64_t begin, uint64_t end) const {
  // The header's entries are in data order (ReadHeader checks they tile the data region).
  const auto& entries = header_.tensors;
  auto after = std::upper_bound(entries.begin(), entries.end(), begin,
                                [](uint64_t at, const TensorEntry& e) { return at < e.begin; });
  if (after == entries.begin()) return nullptr;
  const TensorEntry& e = *std::prev(after);
  return begin >= e.begin && end <= e.end && begin < end ? &e : nullptr;
}

absl::Status ShardReader::ReadEntry(const TensorEntry& entry, void* dst,
                                    const std::string& expected_checksum) const {
  CKPT_RETURN_IF_ERROR(Annotate(
      object_->ReadAt(dst, entry.end - entry.begin, header_.data_start + entry.begin),
      fmt::format("{} tensor {}", path_, entry.name)));
  std::string actual = ChecksumOf(dst, entry.end - entry.begin);
  if (actual != expected_checksum) {
    return absl::DataLossError(fmt::format("tensor {} in {}: checksum mismatch (manifest {}, file {})",
                                           entry.name, path_, expected_checksum, actual));
  }
  return absl::OkStatus();
}

absl::Status ShardReader::ReadRange(const TensorEntry& entry, const Checksums& checksums,
                                    uint64_t from, uint64_t to, const RangeSink& sink,
                                    uint64_t* read_bytes) const {
  const uint64_t size = entry.end - entry.begin;
  if (from > to || to > size) {
    return absl::InvalidArgumentError(fmt::format("tensor {} in {}: range [{}, {}) outside its {} bytes",
                                                  entry.name, path_, from, to, size));
  }
  if (from == to) return absl::OkStatus();
  const bool chunked = !checksums.chunks.empty() && checksums.chunk_bytes != 0;
  if (chunked && checksums.chunks.size() != (size + checksums.chunk_bytes - 1) / checksums.chunk_bytes) {
    return absl::DataLossError(fmt::format("tensor {} in {}: {} chunk checksums for {} bytes",
                                           entry.name, path_, checksums.chunks.size(), size));
  }
  // Windows are whole chunks (or the whole entry): what is read can be checked.
  const uint64_t unit = chunked ? checksums.chunk_bytes : size;
  const uint64_t window = chunked ? std::max(unit, kReadWindowBytes / unit * unit) : size;
  const uint64_t first = from / unit * unit;
  const uint64_t last = std::min(size, (to + unit - 1) / unit * unit);
  std::unique_ptr<char[]> buffer(new (std::nothrow) char[std::min(window, last - first)]);
  if (buffer == nullptr) {
    return absl::ResourceExhaustedError(fmt::format(
        "tensor {} in {}: no memory for a {}-byte read window", entry.name, path_,
        std::min(window, last - first)));
  }
  for (uint64_t at = first; at < last; at += window) {
    const uint64_t n = std::min(window, last - at);
    CKPT_RETURN_IF_ERROR(Annotate(
        object_->ReadAt(buffer.get(), n, header_.data_start + entry.begin + at),
        fmt::format("{} tensor {}", path_, entry.name)));
    if (read_bytes != nullptr) *read_bytes += n;
    for (uint64_t c = 0; c < n; c += unit) {
      const uint64_t len = std::min(unit, n - c);
      const std::string& expected = chunked ? checksums.chunks[(at + c) / unit] : checksums.whole;
      std::string actual = ChecksumOf(buffer.get() + c, len);
      if (actual != expected) {
        return absl::DataLossError(fmt::format(
            "tensor {} in {}: checksum mismatch in bytes [{}, {}) (manifest {}, file {})",
            entry.name, path_, at + c, at + c + len, expected, actual));
      }
    }
    const uint64_t begin = std::max(from, at), end = std::min(to, at + n);
    sink(begin, buffer.get() + (begin - at), end - begin);
  }
  return absl::OkStatus();
}

}  // namespace ckpt::format
