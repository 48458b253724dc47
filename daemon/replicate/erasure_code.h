// Reed-Solomon erasure coding of a byte buffer into k data and m parity fragments, any k of
// which rebuild it: what a coding group of k + m nodes holds of one node's staged snapshot
// (docs/architecture.md, "Peer replicas"). Intel ISA-L does the arithmetic (GF(2^8), a
// Cauchy generator matrix, so that every k x k submatrix inverts), as in Ceph and HDFS.
// Pure and thread-safe once made: encode and decode calls share nothing but the tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/scattered_bytes.h"

namespace ckpt::replicate {

// The largest k + m: a coding group is a handful of nodes, and GF(2^8) allows 255.
inline constexpr int kMaxFragments = 32;

// One fragment of a coded buffer: its index (0..k-1 data, k..k+m-1 parity) and bytes.
struct FragmentView {
  int index = 0;
  std::span<const uint8_t> bytes;
};

class ErasureCode {
 public:
  // InvalidArgument, naming the numbers, unless 1 <= k, 0 <= m and k + m <= kMaxFragments.
  static absl::StatusOr<ErasureCode> Make(int k, int m);

  int k() const { return k_; }
  int m() const { return m_; }
  // Each fragment's size for `data_bytes` of data: the data split in k, rounded up to 64
  // bytes (ISA-L's vector width), the last data fragment zero-padded.
  static size_t FragmentBytes(size_t data_bytes, int k);
  size_t FragmentBytes(size_t data_bytes) const { return FragmentBytes(data_bytes, k_); }

  // Writes the k + m fragments of `data` into `fragments` (k + m buffers of
  // FragmentBytes(data.size()) each), on up to `threads` threads (each a range of columns).
  // `data` may lie in several places (a snapshot's own and frozen blocks): the data
  // fragments are copied out of it first either way.
  absl::Status Encode(const ScatteredBytes& data, std::span<uint8_t* const> fragments, int threads = 1) const;
  absl::Status Encode(std::span<const uint8_t> data, std::span<uint8_t* const> fragments, int threads = 1) const {
    return Encode(ScatteredBytes(reinterpret_cast<const char*>(data.data()), data.size()), fragments, threads);
  }

  // Columns [begin, end) of the first `fragments.size()` fragments of `data` (at least the k
  // data fragments, at most all k + m), each into a buffer of end - begin bytes: exactly
  // what Encode writes there. Reed-Solomon works column by column (byte j of every fragment
  // is a function of byte j of the k data fragments alone), so the columns of a changed
  // part of the data are coded from the new data alone (a patch, shard_fragments.h).
  // InvalidArgument unless begin <= end <= FragmentBytes(data.size()).
  absl::Status EncodeColumns(const ScatteredBytes& data, size_t begin, size_t end,
                             std::span<uint8_t* const> fragments, int threads = 1) const;
  absl::Status EncodeColumns(std::span<const uint8_t> data, size_t begin, size_t end,
                             std::span<uint8_t* const> fragments, int threads = 1) const {
    return EncodeColumns(ScatteredBytes(reinterpret_cast<const char*>(data.data()), data.size()), begin, end,
                         fragments, threads);
  }

  // Rebuilds the `out.size()` bytes of data from any k distinct fragments (more are
  // ignored), each FragmentBytes(out.size()) long. A data fragment that already lies where
  // it belongs in `out` (fetched straight there) is not copied. InvalidArgument, naming what is wrong,
  // for fewer than k, repeated or out-of-range indices, or fragments of the wrong size.
  // Corruption is not detected here: fragments carry checksums of their own.
  absl::Status Decode(std::span<const FragmentView> fragments, std::span<uint8_t> out, int threads = 1) const;

  // How Encode and Decode split `len` columns over up to `threads` threads: whole 64-byte
  // runs, at least 1 MiB each, that cover [0, len) exactly, in order.
  static std::vector<std::pair<size_t, size_t>> ColumnRanges(size_t len, int threads);

 private:
  ErasureCode(int k, int m);
  // Runs `rows` outputs of ec_encode_data over columns [0, len), split over threads.
  static void Run(size_t len, int k, int rows, const std::vector<uint8_t>& tables, uint8_t* const* in,
                  uint8_t* const* out, int threads);

  int k_;
  int m_;
  std::vector<uint8_t> matrix_;  // (k + m) x k: identity above, Cauchy below
  std::vector<uint8_t> encode_tables_;  // ec_init_tables of the parity rows
};

}  // namespace ckpt::replicate
