#include "daemon/persist/increment_chunks.h"

#include <fmt/format.h>

#include <algorithm>

#include "format/increment.h"

namespace ckpt::persist {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Windows of `target` bytes rounded down to whole elements (one at least), grown to fit
// `max_chunks`.
uint64_t Windows(uint64_t bytes, size_t itemsize, uint64_t target, uint64_t max_chunks) {
  uint64_t window = std::max<uint64_t>(itemsize, target / itemsize * itemsize);
  if (CeilDiv(bytes, window) > max_chunks) window = CeilDiv(CeilDiv(bytes, max_chunks), itemsize) * itemsize;
  return window;
}

}  // namespace

absl::Status CheckIncrementChunkBytes(uint64_t bytes) {
  if (bytes >= kMinIncrementChunkBytes && bytes <= kMaxIncrementChunkBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "--increment-chunk-bytes {} is outside the allowed range, {} (64 KiB) to {} (64 MiB); the default is {} (4 MiB)",
      bytes, kMinIncrementChunkBytes, kMaxIncrementChunkBytes, kDefaultIncrementChunkBytes));
}

uint64_t SparsePieceMaxChunks(uint64_t bytes, uint64_t rank_sparse_bytes, uint32_t local_ranks) {
  const uint64_t rank_share = kSparseChunksPerNode / std::max<uint32_t>(local_ranks, 1);
  // The piece's part of the rank's share, by size (in long double: bytes times a share of a
  // million passes 64 bits past 16 TB).
  const uint64_t share = rank_sparse_bytes == 0
                             ? rank_share
                             : static_cast<uint64_t>(static_cast<long double>(rank_share) * bytes /
                                                     static_cast<long double>(rank_sparse_bytes));
  return std::clamp<uint64_t>(share, format::kMaxPieceChunks, format::kMaxReadPieceChunks);
}

uint64_t PieceChunkBytes(const std::vector<int64_t>& shape, size_t itemsize, bool flat, uint64_t target,
                         bool sparse, uint64_t max_chunks) {
  max_chunks = std::clamp<uint64_t>(max_chunks, 1, format::kMaxReadPieceChunks);
  if (sparse) target = kSparseChunkBytes;
  target = std::max<uint64_t>(target, itemsize);
  uint64_t elements = 1;
  for (int64_t d : shape) elements *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  const uint64_t bytes = elements * itemsize;
  if (bytes <= target) return std::max<uint64_t>(bytes, itemsize);
  if (flat || shape.size() < 2) return Windows(bytes, itemsize, target, max_chunks);
  // Row blocks. bytes > target > 0, so the first dimension and a row are not empty.
  const uint64_t rows = static_cast<uint64_t>(shape[0]);
  const uint64_t row_bytes = bytes / rows;
  if (row_bytes > target && !sparse) return Windows(bytes, itemsize, target, max_chunks);
  uint64_t block = std::max<uint64_t>(1, target / row_bytes);
  if (CeilDiv(rows, block) > max_chunks) block = CeilDiv(rows, max_chunks);
  return block * row_bytes;
}

}  // namespace ckpt::persist
