// Encoding of a snapshot command's payload (user metadata + small train-state blobs) into a
// ring slot. The daemon decodes untrusted bytes, so decoding checks every length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::shm {

struct NamedBlob {
  std::string name;
  std::string data;
};

struct SnapshotPayload {
  std::map<std::string, std::string> metadata;
  std::vector<NamedBlob> train_state;
};

// Metadata entries, and train-state entries, one payload may hold.
inline constexpr uint32_t kMaxPayloadEntries = 16384;

// Bytes EncodePayload would write.
size_t EncodedSize(const SnapshotPayload& payload);

// Writes `payload` to out[0, capacity); ResourceExhausted when it does not fit,
// InvalidArgument for an entry over 4 GiB or more than kMaxPayloadEntries entries.
absl::StatusOr<size_t> EncodePayload(const SnapshotPayload& payload, uint8_t* out,
                                     size_t capacity);

absl::StatusOr<SnapshotPayload> DecodePayload(const uint8_t* data, size_t size);

}  // namespace ckpt::shm
