#include "daemon/replicate/erasure_code.h"

#include <fmt/format.h>
#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstring>

#include "daemon/replicate/run_on_ranges.h"

namespace ckpt::replicate {
namespace {

constexpr size_t kAlign = 64;
// Columns a thread takes at least: below this, a thread costs more than it saves.
constexpr size_t kMinColumnsPerThread = size_t{1} << 20;
// ec_encode_data takes an int length: columns go through in slices of this many.
constexpr size_t kMaxSlice = size_t{1} << 30;

}  // namespace

absl::StatusOr<ErasureCode> ErasureCode::Make(int k, int m) {
  if (k < 1 || m < 0 || k + m > kMaxFragments) {
    return absl::InvalidArgumentError(fmt::format(
        "erasure code {}+{}: needs at least 1 data fragment, no negative parity and at most {} fragments in all",
        k, m, kMaxFragments));
  }
  return ErasureCode(k, m);
}

ErasureCode::ErasureCode(int k, int m) : k_(k), m_(m), matrix_(static_cast<size_t>((k + m) * k)) {
  gf_gen_cauchy1_matrix(matrix_.data(), k + m, k);
  encode_tables_.resize(static_cast<size_t>(32 * k * std::max(m, 1)));
  if (m > 0) ec_init_tables(k, m, &matrix_[static_cast<size_t>(k * k)], encode_tables_.data());
}

size_t ErasureCode::FragmentBytes(size_t data_bytes, int k) {
  const size_t per = (data_bytes + static_cast<size_t>(k) - 1) / static_cast<size_t>(k);
  return std::max(kAlign, (per + kAlign - 1) / kAlign * kAlign);
}

void ErasureCode::Run(size_t len, int k, int rows, const std::vector<uint8_t>& tables, uint8_t* const* in,
                      uint8_t* const* out, int threads) {
  if (rows == 0 || len == 0) return;
  auto columns = [&](size_t begin, size_t end) {
    std::vector<uint8_t*> src(static_cast<size_t>(k)), dst(static_cast<size_t>(rows));
    for (size_t at = begin; at < end; at += kMaxSlice) {
      const size_t n = std::min(kMaxSlice, end - at);
      for (int i = 0; i < k; ++i) src[static_cast<size_t>(i)] = in[i] + at;
      for (int i = 0; i < rows; ++i) dst[static_cast<size_t>(i)] = out[i] + at;
      ec_encode_data(static_cast<int>(n), k, rows, const_cast<uint8_t*>(tables.data()), src.data(), dst.data());
    }
  };
  RunOnRanges(ColumnRanges(len, threads), columns);
}

std::vector<std::pair<size_t, size_t>> ErasureCode::ColumnRanges(size_t len, int threads) {
  const size_t want = std::clamp<size_t>(len / kMinColumnsPerThread, 1, static_cast<size_t>(std::max(threads, 1)));
  // Rounded up twice (to the share, then to 64 bytes), so that `want` shares reach `len`;
  // the last range ends at `len` whatever the rounding.
  const size_t share = ((len + want - 1) / want + kAlign - 1) / kAlign * kAlign;
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t begin = 0; begin < len || out.empty(); begin += share) {
    out.emplace_back(begin, std::min(len, begin + share));
    if (out.back().second == len) break;
  }
  out.back().second = len;
  return out;
}

absl::Status ErasureCode::Encode(const ScatteredBytes& data, std::span<uint8_t* const> fragments,
                                 int threads) const {
  if (fragments.size() != static_cast<size_t>(k_ + m_)) {
    return absl::InvalidArgumentError(
        fmt::format("erasure code {}+{}: {} fragment buffers given, {} needed", k_, m_, fragments.size(), k_ + m_));
  }
  const size_t len = FragmentBytes(data.size());
  // Data fragments are the data itself, cut in k; the tail of the last ones zero-filled.
  for (int i = 0; i < k_; ++i) {
    const size_t begin = std::min(data.size(), static_cast<size_t>(i) * len);
    const size_t n = std::min(len, data.size() - begin);
    data.CopyTo(begin, n, fragments[static_cast<size_t>(i)]);
    std::memset(fragments[static_cast<size_t>(i)] + n, 0, len - n);
  }
  Run(len, k_, m_, encode_tables_, fragments.data(), fragments.data() + k_, threads);
  return absl::OkStatus();
}

absl::Status ErasureCode::EncodeColumns(const ScatteredBytes& data, size_t begin, size_t end,
                                        std::span<uint8_t* const> fragments, int threads) const {
  if (fragments.size() < static_cast<size_t>(k_) || fragments.size() > static_cast<size_t>(k_ + m_)) {
    return absl::InvalidArgumentError(fmt::format("erasure code {}+{}: {} fragment buffers given, {} to {} needed", k_,
                                                  m_, fragments.size(), k_, k_ + m_));
  }
  const size_t len = FragmentBytes(data.size());
  if (begin > end || end > len) {
    return absl::InvalidArgumentError(fmt::format(
        "erasure code {}+{}: columns [{}, {}) are not within fragments of {} bytes", k_, m_, begin, end, len));
  }
  const size_t width = end - begin;
  // Data fragment i's columns are the data's bytes [i * len + begin, i * len + end), those
  // past its end zero (as Encode pads the last data fragments).
  for (int i = 0; i < k_; ++i) {
    const size_t from = std::min(data.size(), static_cast<size_t>(i) * len + begin);
    const size_t n = std::min(width, data.size() - from);
    data.CopyTo(from, n, fragments[static_cast<size_t>(i)]);
    std::memset(fragments[static_cast<size_t>(i)] + n, 0, width - n);
  }
  // The parity rows asked for are the first rows of the tables (ec_init_tables lays them out
  // row after row).
  Run(width, k_, static_cast<int>(fragments.size()) - k_, encode_tables_, fragments.data(), fragments.data() + k_,
      threads);
  return absl::OkStatus();
}

absl::Status ErasureCode::Decode(std::span<const FragmentView> fragments, std::span<uint8_t> out,
                                 int threads) const {
  const size_t len = FragmentBytes(out.size());
  std::vector<const FragmentView*> by_index(static_cast<size_t>(k_ + m_), nullptr);
  std::vector<int> chosen;  // the first k distinct fragments given, data fragments first
  for (const FragmentView& f : fragments) {
    if (f.index < 0 || f.index >= k_ + m_) {
      return absl::InvalidArgumentError(
          fmt::format("erasure code {}+{}: fragment index {} is out of range", k_, m_, f.index));
    }
    if (by_index[static_cast<size_t>(f.index)] != nullptr) {
      return absl::InvalidArgumentError(
          fmt::format("erasure code {}+{}: fragment {} given twice", k_, m_, f.index));
    }
    if (f.bytes.size() != len) {
      return absl::InvalidArgumentError(fmt::format(
          "erasure code {}+{}: fragment {} holds {} bytes; {} bytes of data need {}", k_, m_, f.index,
          f.bytes.size(), out.size(), len));
    }
    by_index[static_cast<size_t>(f.index)] = &f;
  }
  for (int i = 0; i < k_ + m_ && static_cast<int>(chosen.size()) < k_; ++i) {
    if (by_index[static_cast<size_t>(i)] != nullptr) chosen.push_back(i);
  }
  if (static_cast<int>(chosen.size()) < k_) {
    return absl::InvalidArgumentError(fmt::format(
        "erasure code {}+{}: {} distinct fragments cannot rebuild the data, {} are needed", k_, m_,
        chosen.size(), k_));
  }
  // Data fragments at hand are copied; the missing ones are rows of the inverse of the
  // chosen rows' submatrix, applied to the chosen fragments.
  std::vector<int> missing;
  for (int i = 0; i < k_; ++i) {
    const FragmentView* f = by_index[static_cast<size_t>(i)];
    const size_t begin = std::min(out.size(), static_cast<size_t>(i) * len);
    const size_t n = std::min(len, out.size() - begin);
    if (f == nullptr) {
      missing.push_back(i);
    } else if (n > 0 && f->bytes.data() != out.data() + begin) {  // not received in place already
      std::memcpy(out.data() + begin, f->bytes.data(), n);
    }
  }
  if (missing.empty()) return absl::OkStatus();
  const size_t kk = static_cast<size_t>(k_);
  std::vector<uint8_t> sub(kk * kk), inverse(kk * kk);
  for (size_t r = 0; r < kk; ++r) {
    std::memcpy(&sub[r * kk], &matrix_[static_cast<size_t>(chosen[r]) * kk], kk);
  }
  if (gf_invert_matrix(sub.data(), inverse.data(), k_) != 0) {
    return absl::InternalError(fmt::format("erasure code {}+{}: the chosen fragments' matrix is singular", k_, m_));
  }
  std::vector<uint8_t> rows(missing.size() * kk);
  for (size_t r = 0; r < missing.size(); ++r) {
    std::memcpy(&rows[r * kk], &inverse[static_cast<size_t>(missing[r]) * kk], kk);
  }
  std::vector<uint8_t> tables(32 * kk * missing.size());
  ec_init_tables(k_, static_cast<int>(missing.size()), rows.data(), tables.data());
  std::vector<uint8_t*> in(kk);
  for (size_t r = 0; r < kk; ++r) {
    in[r] = const_cast<uint8_t*>(by_index[static_cast<size_t>(chosen[r])]->bytes.data());
  }
  // A rebuilt fragment goes straight into `out` where it lies whole in it; the tail
  // fragment (or one past the data) through a buffer of its own.
  std::vector<std::vector<uint8_t>> spare;
  std::vector<uint8_t*> dst(missing.size());
  for (size_t r = 0; r < missing.size(); ++r) {
    const size_t begin = static_cast<size_t>(missing[r]) * len;
    if (begin + len <= out.size()) {
      dst[r] = out.data() + begin;
    } else {
      dst[r] = spare.emplace_back(len).data();
    }
  }
  Run(len, k_, static_cast<int>(missing.size()), tables, in.data(), dst.data(), threads);
  for (size_t r = 0; r < missing.size(); ++r) {
    const size_t begin = static_cast<size_t>(missing[r]) * len;
    if (begin + len > out.size() && begin < out.size()) std::memcpy(out.data() + begin, dst[r], out.size() - begin);
  }
  return absl::OkStatus();
}

}  // namespace ckpt::replicate
