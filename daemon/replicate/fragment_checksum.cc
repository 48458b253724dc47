#include "daemon/replicate/fragment_checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <optional>

#include "format/checksum.h"

namespace ckpt::replicate {
namespace {

constexpr std::string_view kChunkedPrefix = "xxh3c:";

// The chunk size a chunked checksum names; nullopt when it is not one or out of range.
std::optional<size_t> ChunkOf(std::string_view checksum) {
  if (checksum.substr(0, kChunkedPrefix.size()) != kChunkedPrefix) return std::nullopt;
  checksum.remove_prefix(kChunkedPrefix.size());
  const size_t colon = checksum.find(':');
  if (colon == std::string_view::npos || colon == 0 || checksum.size() - colon - 1 != 16) return std::nullopt;
  size_t chunk = 0;
  auto [ptr, ec] = std::from_chars(checksum.data(), checksum.data() + colon, chunk);
  if (ec != std::errc() || ptr != checksum.data() + colon) return std::nullopt;
  if (chunk < kMinChecksumChunkBytes || chunk > kMaxChecksumChunkBytes || chunk % 64 != 0) return std::nullopt;
  return chunk;
}

}  // namespace

std::vector<uint64_t> ChunkSums(const void* data, size_t size, size_t chunk_bytes) {
  std::vector<uint64_t> out;
  out.reserve((size + chunk_bytes - 1) / chunk_bytes);
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t at = 0; at < size; at += chunk_bytes) out.push_back(XXH3_64bits(p + at, std::min(chunk_bytes, size - at)));
  return out;
}

uint64_t PaddedSum(const void* data, size_t have, size_t size) {
  if (have >= size) return XXH3_64bits(data, size);
  static constexpr uint8_t kZeros[4096] = {};
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, data, have);
  for (size_t left = size - have; left > 0;) {
    const size_t n = std::min(left, sizeof(kZeros));
    XXH3_64bits_update(state, kZeros, n);
    left -= n;
  }
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

std::string ChunkedChecksum(std::span<const uint64_t> chunk_sums, size_t chunk_bytes) {
  std::vector<uint8_t> packed(chunk_sums.size() * 8);
  for (size_t i = 0; i < chunk_sums.size(); ++i) {
    for (int b = 0; b < 8; ++b) packed[i * 8 + static_cast<size_t>(b)] = static_cast<uint8_t>(chunk_sums[i] >> (8 * b));
  }
  return fmt::format("{}{}:{:016x}", kChunkedPrefix, chunk_bytes, XXH3_64bits(packed.data(), packed.size()));
}

std::string ChecksumLike(const void* data, size_t size, std::string_view like) {
  if (std::optional<size_t> chunk = ChunkOf(like)) return ChunkedChecksum(ChunkSums(data, size, *chunk), *chunk);
  return format::ChecksumOf(data, size);
}

bool ChecksumMatches(const void* data, size_t size, std::string_view checksum) {
  if (ChunkOf(checksum)) return ChecksumLike(data, size, checksum) == checksum;
  return format::ParseChecksumText(checksum).has_value() && format::ChecksumOf(data, size) == checksum;
}

}  // namespace ckpt::replicate
