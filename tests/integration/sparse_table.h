// An embedding-like table updated sparsely, as a trainer with sparse gradients updates one:
// at every training step t >= 1, `percent` % of its rows (at least one), drawn at random
// from a generator seeded by (seed, t), are rewritten with bytes of (seed, t, row). Its
// content at step s is therefore a function of (seed, s) alone: each row holds what the last
// step <= s that drew it wrote (what step 0 wrote when none did), so a restore of step s is
// checked bit for bit, and between two saves s1 < s2 the rows that changed are those the
// steps (s1, s2] drew: `percent` % of them per training step. Used by trainer_helper
// (--sparse-rows) and ckpt_bench.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace ckpt::testing {

class SparseTable {
 public:
  // A table of `rows` rows of `row_bytes` bytes (a multiple of 8) at `data`, not owned.
  SparseTable(void* data, uint64_t rows, uint64_t row_bytes, uint64_t seed, double percent)
      : data_(static_cast<uint8_t*>(data)), rows_(rows), row_bytes_(row_bytes), seed_(seed), percent_(percent) {}

  // How many rows one training step draws (with repetition, so distinct rows may be fewer).
  uint64_t RowsPerStep() const {
    if (rows_ == 0) return 0;
    return std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(static_cast<double>(rows_) * percent_ / 100)));
  }

  // The rows training step `t` rewrites.
  std::vector<uint64_t> Drawn(uint64_t t) const {
    std::mt19937_64 random(seed_ * 0x9E3779B97F4A7C15ULL ^ (t + 1) * 0xD1B54A32D192ED03ULL);
    std::vector<uint64_t> rows(RowsPerStep());
    for (uint64_t& r : rows) r = std::uniform_int_distribution<uint64_t>(0, rows_ - 1)(random);
    return rows;
  }

  // Brings the table to its content at step `s`: from where it is when `s` is later (only
  // the rows the steps in between drew are written), from step 0 otherwise.
  void AdvanceTo(uint64_t s) {
    if (!filled_ || s < step_) {
      for (uint64_t r = 0; r < rows_; ++r) WriteRow(data_, 0, r);
      step_ = 0;
      filled_ = true;
    }
    for (uint64_t t = step_ + 1; t <= s; ++t) {
      for (uint64_t r : Drawn(t)) WriteRow(data_, t, r);
    }
    step_ = s;
  }

  // The first byte of `table` (rows_ x row_bytes_) that differs from the content at step
  // `s`, or -1 when none does.
  int64_t FirstMismatch(const void* table, uint64_t s) const {
    std::vector<uint8_t> expected(rows_ * row_bytes_);
    SparseTable want(expected.data(), rows_, row_bytes_, seed_, percent_);
    want.AdvanceTo(s);
    const auto* got = static_cast<const uint8_t*>(table);
    auto [a, b] = std::mismatch(expected.begin(), expected.end(), got);
    return a == expected.end() ? -1 : static_cast<int64_t>(a - expected.begin());
  }

 private:
  static uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
  }
  void WriteRow(uint8_t* table, uint64_t t, uint64_t r) const {
    uint64_t x = Mix(seed_ ^ Mix(t * 0x9E3779B97F4A7C15ULL ^ Mix(r + 1)));
    uint8_t* row = table + r * row_bytes_;
    for (uint64_t i = 0; i < row_bytes_; i += 8) {
      x = Mix(x + 0x9E3779B97F4A7C15ULL);
      std::memcpy(row + i, &x, 8);
    }
  }

  uint8_t* data_;
  uint64_t rows_, row_bytes_, seed_;
  double percent_;
  uint64_t step_ = 0;
  bool filled_ = false;
};

}  // namespace ckpt::testing
