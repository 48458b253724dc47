// A fragment's checksum in either of two forms (docs/architecture.md, "Peer replicas"):
//   "xxh3:<16 hex>"                 XXH3-64 of the fragment's bytes (format/checksum.h): a
//                                   fragment sent whole;
//   "xxh3c:<chunk bytes>:<16 hex>"  XXH3-64 of the XXH3-64s of its chunks of <chunk bytes>
//                                   (the last one shorter), each as 8 little-endian bytes: a
//                                   fragment sent as a patch of its changed chunks. The owner,
//                                   which never has the whole new parity fragment, knows it
//                                   from the chunk sums it keeps; the holder checks it over
//                                   the fragment it built.
// Pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt::replicate {

// What a chunked checksum's chunk may be: a multiple of 64 bytes (ISA-L's width) in this range.
inline constexpr size_t kMinChecksumChunkBytes = 64;
inline constexpr size_t kMaxChecksumChunkBytes = size_t{64} << 20;

// XXH3-64 of each chunk of `chunk_bytes` of [data, data + size), the last one shorter.
std::vector<uint64_t> ChunkSums(const void* data, size_t size, size_t chunk_bytes);
// XXH3-64 of `size` bytes that are `data`'s `have` bytes followed by zeros (a chunk of a
// zero-padded data fragment, without the padding in memory).
uint64_t PaddedSum(const void* data, size_t have, size_t size);
// "xxh3c:<chunk bytes>:<16 hex>" of a fragment whose chunks hash to `chunk_sums`.
std::string ChunkedChecksum(std::span<const uint64_t> chunk_sums, size_t chunk_bytes);
// Whether `checksum`, in either form, is that of [data, data + size). False for a malformed
// one (an unknown form, a chunk size out of range).
bool ChecksumMatches(const void* data, size_t size, std::string_view checksum);
// The checksum of [data, data + size) in the form of `like` (for messages); the whole form
// when `like` is malformed.
std::string ChecksumLike(const void* data, size_t size, std::string_view like);

}  // namespace ckpt::replicate
