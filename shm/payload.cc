#include "shm/payload.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstring>

namespace ckpt::shm {
namespace {

// Layout: u32 n_metadata, n x (u32 klen, k, u32 vlen, v), u32 n_blobs, n x (u32 nlen, name,
// u32 dlen, data). Little-endian host order: both ends are on the same node.
class Writer {
 public:
  Writer(uint8_t* out, size_t capacity) : out_(out), capacity_(capacity) {}
  void U32(uint32_t v) { Bytes(&v, sizeof v); }
  void String(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  size_t size() const { return size_; }

 private:
  void Bytes(const void* p, size_t n) {
    if (out_ != nullptr && size_ + n <= capacity_) std::memcpy(out_ + size_, p, n);
    size_ += n;
  }
  uint8_t* out_;
  size_t capacity_;
  size_t size_ = 0;
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool U32(uint32_t* v) {
    if (size_ - pos_ < sizeof *v) return false;
    std::memcpy(v, data_ + pos_, sizeof *v);
    pos_ += sizeof *v;
    return true;
  }
  bool AtEnd() const { return pos_ == size_; }
  bool String(std::string* s) {
    uint32_t n;
    if (!U32(&n) || size_ - pos_ < n) return false;
    s->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return true;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

void Encode(const SnapshotPayload& payload, Writer& w) {
  w.U32(static_cast<uint32_t>(payload.metadata.size()));
  for (const auto& [key, value] : payload.metadata) {
    w.String(key);
    w.String(value);
  }
  w.U32(static_cast<uint32_t>(payload.train_state.size()));
  for (const auto& blob : payload.train_state) {
    w.String(blob.name);
    w.String(blob.data);
  }
}

}  // namespace

size_t EncodedSize(const SnapshotPayload& payload) {
  Writer w(nullptr, 0);
  Encode(payload, w);
  return w.size();
}

absl::StatusOr<size_t> EncodePayload(const SnapshotPayload& payload, uint8_t* out,
                                     size_t capacity) {
  // Lengths are 32-bit: a larger entry would be written as its size modulo 2^32.
  for (const auto& [key, value] : payload.metadata) {
    if (value.size() > UINT32_MAX || key.size() > UINT32_MAX) {
      return absl::InvalidArgumentError(fmt::format("metadata \"{}\" is larger than 4 GiB", key.substr(0, 64)));
    }
  }
  for (const auto& blob : payload.train_state) {
    if (blob.data.size() > UINT32_MAX || blob.name.size() > UINT32_MAX) {
      return absl::InvalidArgumentError(fmt::format(
          "train state \"{}\" takes {} bytes; one entry holds at most 4 GiB (put it in a tensor)",
          blob.name.substr(0, 64), blob.data.size()));
    }
  }
  if (payload.metadata.size() > kMaxPayloadEntries || payload.train_state.size() > kMaxPayloadEntries) {
    return absl::InvalidArgumentError(fmt::format(
        "{} metadata entries and {} train-state entries; at most {} of each", payload.metadata.size(),
        payload.train_state.size(), kMaxPayloadEntries));
  }
  size_t needed = EncodedSize(payload);
  if (needed > capacity) {
    return absl::ResourceExhaustedError(fmt::format(
        "snapshot metadata and train state take {} bytes; at most {} fit in one command",
        needed, capacity));
  }
  Writer w(out, capacity);
  Encode(payload, w);
  return w.size();
}

absl::StatusOr<SnapshotPayload> DecodePayload(const uint8_t* data, size_t size) {
  Reader r(data, size);
  SnapshotPayload payload;
  uint32_t count;
  auto malformed = [] { return absl::InvalidArgumentError("malformed snapshot payload"); };
  // Counts are bounded before anything is allocated: 12 million empty entries fit in
  // 100 MB of payload and would take a gigabyte once decoded.
  if (!r.U32(&count) || count > kMaxPayloadEntries) return malformed();
  for (uint32_t i = 0; i < count; ++i) {
    std::string key, value;
    if (!r.String(&key) || !r.String(&value)) return malformed();
    payload.metadata[key] = std::move(value);
  }
  if (!r.U32(&count) || count > kMaxPayloadEntries) return malformed();
  for (uint32_t i = 0; i < count; ++i) {
    NamedBlob blob;
    if (!r.String(&blob.name) || !r.String(&blob.data)) return malformed();
    payload.train_state.push_back(std::move(blob));
  }
  if (!r.AtEnd()) return malformed();  // what follows the last entry was never written by a client
  return payload;
}

}  // namespace ckpt::shm
