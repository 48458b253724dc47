// Any k of a buffer's k + m fragments rebuild it exactly, whichever m are lost; bad input
// is refused, naming what is wrong.
#include <catch2/catch.hpp>

#include <bit>
#include <numeric>
#include <random>
#include <vector>

#include "common/status.h"
#include "daemon/replicate/erasure_code.h"

using ckpt::replicate::ErasureCode;
using ckpt::replicate::FragmentView;

namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

struct Coded {
  std::vector<std::vector<uint8_t>> fragments;
};

Coded Encode(const ErasureCode& code, const std::vector<uint8_t>& data, int threads = 1) {
  Coded c;
  c.fragments.assign(static_cast<size_t>(code.k() + code.m()), std::vector<uint8_t>(code.FragmentBytes(data.size()), 0xee));
  std::vector<uint8_t*> ptrs;
  for (auto& f : c.fragments) ptrs.push_back(f.data());
  REQUIRE(code.Encode(data, ptrs, threads).ok());
  return c;
}

// The data rebuilt from the fragments whose bit is clear in `lost`.
std::vector<uint8_t> DecodeWithout(const ErasureCode& code, const Coded& c, uint32_t lost, size_t bytes,
                                   int threads = 1) {
  std::vector<FragmentView> kept;
  for (int i = 0; i < code.k() + code.m(); ++i) {
    if (!(lost >> i & 1)) kept.push_back({i, c.fragments[static_cast<size_t>(i)]});
  }
  std::vector<uint8_t> out(bytes, 0x5a);
  absl::Status s = code.Decode(kept, out, threads);
  INFO(ckpt::Message(s));
  REQUIRE(s.ok());
  return out;
}

}  // namespace

TEST_CASE("every loss of up to m fragments is rebuilt exactly, for several codes and sizes") {
  for (auto [k, m] : std::vector<std::pair<int, int>>{{1, 0}, {1, 1}, {1, 2}, {2, 1}, {3, 2}, {4, 2}, {6, 3}}) {
    auto code = ErasureCode::Make(k, m);
    REQUIRE(code.ok());
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{4096 * 3 + 17}}) {
      const std::vector<uint8_t> data = RandomBytes(bytes, static_cast<uint32_t>(bytes * 31 + k * 7 + m));
      const Coded c = Encode(*code, data);
      // Data fragments are the data itself.
      const size_t len = code->FragmentBytes(bytes);
      for (int i = 0; i < k; ++i) {
        for (size_t b = 0; b < len; ++b) {
          const size_t at = static_cast<size_t>(i) * len + b;
          if (c.fragments[static_cast<size_t>(i)][b] != (at < bytes ? data[at] : 0)) FAIL("data fragment " << i);
        }
      }
      for (uint32_t lost = 0; lost < (1u << (k + m)); ++lost) {
        if (std::popcount(lost) > m) continue;
        INFO(k << "+" << m << ", " << bytes << " bytes, lost mask " << lost);
        CHECK(DecodeWithout(*code, c, lost, bytes) == data);
      }
    }
  }
}

TEST_CASE("threads split the columns and give the same fragments and data") {
  auto code = ErasureCode::Make(4, 2);
  REQUIRE(code.ok());
  const std::vector<uint8_t> data = RandomBytes((size_t{9} << 20) + 12345, 7);
  const Coded one = Encode(*code, data, 1);
  const Coded four = Encode(*code, data, 4);
  CHECK(one.fragments == four.fragments);
  CHECK(DecodeWithout(*code, four, 0b000101, data.size(), 3) == data);  // data fragments 0 and 2 lost
  CHECK(DecodeWithout(*code, four, 0b100010, data.size(), 2) == data);  // one data, one parity
}

TEST_CASE("the threads' column ranges cover every column once, in whole 64-byte runs") {
  for (size_t len : {size_t{0}, size_t{64}, size_t{1} << 20, (size_t{9} << 20) + 64 * 7,
                     size_t{64} * (128 * 20000 + 1), size_t{3} << 30}) {
    for (int threads : {1, 2, 3, 64, 65, 128, 1000}) {
      auto ranges = ErasureCode::ColumnRanges(len, threads);
      INFO(len << " columns on " << threads << " threads");
      REQUIRE_FALSE(ranges.empty());
      CHECK(ranges.size() <= static_cast<size_t>(threads));
      CHECK(ranges.front().first == 0);
      CHECK(ranges.back().second == len);
      for (size_t i = 0; i < ranges.size(); ++i) {
        CHECK(ranges[i].first % 64 == 0);
        CHECK(ranges[i].first <= ranges[i].second);
        if (i > 0) CHECK(ranges[i].first == ranges[i - 1].second);
      }
    }
  }
}

TEST_CASE("bad codes and bad fragments are refused, naming the problem") {
  CHECK_THAT(ckpt::Message(ErasureCode::Make(0, 1).status()), Catch::Contains("at least 1 data fragment"));
  CHECK_THAT(ckpt::Message(ErasureCode::Make(2, -1).status()), Catch::Contains("2+-1"));
  CHECK_THAT(ckpt::Message(ErasureCode::Make(30, 3).status()), Catch::Contains("at most 32 fragments"));
  auto code = ErasureCode::Make(2, 1);
  REQUIRE(code.ok());
  const std::vector<uint8_t> data = RandomBytes(1000, 1);
  const Coded c = Encode(*code, data);
  std::vector<uint8_t> out(data.size());
  std::vector<FragmentView> one = {{0, c.fragments[0]}};
  CHECK_THAT(ckpt::Message(code->Decode(one, out)), Catch::Contains("1 distinct fragments cannot rebuild the data, 2 are needed"));
  std::vector<FragmentView> twice = {{1, c.fragments[1]}, {1, c.fragments[1]}};
  CHECK_THAT(ckpt::Message(code->Decode(twice, out)), Catch::Contains("fragment 1 given twice"));
  std::vector<FragmentView> outside = {{0, c.fragments[0]}, {3, c.fragments[1]}};
  CHECK_THAT(ckpt::Message(code->Decode(outside, out)), Catch::Contains("fragment index 3 is out of range"));
  std::vector<FragmentView> short_one = {{0, c.fragments[0]}, {2, std::span(c.fragments[2]).first(10)}};
  CHECK_THAT(ckpt::Message(code->Decode(short_one, out)), Catch::Contains("fragment 2 holds 10 bytes"));
  std::vector<uint8_t*> two = {nullptr, nullptr};
  CHECK_THAT(ckpt::Message(code->Encode(data, two)), Catch::Contains("2 fragment buffers given, 3 needed"));
}

TEST_CASE("coding a range of columns writes exactly those columns of a full Encode, for every fragment count") {
  for (auto [k, m] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 2}, {3, 2}}) {
    auto code = ErasureCode::Make(k, m);
    REQUIRE(code.ok());
    for (size_t bytes : {size_t{1}, size_t{100}, size_t{4096 * 3 + 17}, size_t{300'001}}) {
      const std::vector<uint8_t> data = RandomBytes(bytes, static_cast<uint32_t>(bytes + k * 3 + m));
      const Coded full = Encode(*code, data);
      const size_t len = code->FragmentBytes(bytes);
      // Unaligned ranges too: the first column, a middle run, the tail (into the padding).
      for (auto [begin, end] : std::vector<std::pair<size_t, size_t>>{
               {0, len}, {0, 1}, {len / 3, len / 3 + 7}, {len / 2, len}, {len - 1, len}, {len, len}}) {
        for (int n = k; n <= k + m; ++n) {
          INFO(k << "+" << m << ", " << bytes << " bytes, columns [" << begin << ", " << end << "), " << n
                 << " fragments");
          std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n), std::vector<uint8_t>(end - begin, 0xee));
          std::vector<uint8_t*> ptrs;
          for (auto& f : out) ptrs.push_back(f.data());
          REQUIRE(code->EncodeColumns(data, begin, end, ptrs, 2).ok());
          for (int i = 0; i < n; ++i) {
            const auto& whole = full.fragments[static_cast<size_t>(i)];
            CHECK(out[static_cast<size_t>(i)] ==
                  std::vector<uint8_t>(whole.begin() + static_cast<std::ptrdiff_t>(begin),
                                       whole.begin() + static_cast<std::ptrdiff_t>(end)));
          }
        }
      }
    }
  }
}

TEST_CASE("coding columns refuses ranges past the fragments and too few or many buffers") {
  auto code = ErasureCode::Make(2, 1);
  REQUIRE(code.ok());
  const std::vector<uint8_t> data = RandomBytes(1000, 5);
  std::vector<uint8_t> a(64), b(64), c(64), d(64);
  std::vector<uint8_t*> three = {a.data(), b.data(), c.data()};
  const size_t len = code->FragmentBytes(data.size());
  CHECK(absl::IsInvalidArgument(code->EncodeColumns(data, 0, len + 1, three)));
  CHECK(absl::IsInvalidArgument(code->EncodeColumns(data, 10, 9, three)));
  std::vector<uint8_t*> one = {a.data()};
  CHECK(absl::IsInvalidArgument(code->EncodeColumns(data, 0, 64, one)));
  std::vector<uint8_t*> four = {a.data(), b.data(), c.data(), d.data()};
  CHECK(absl::IsInvalidArgument(code->EncodeColumns(data, 0, 64, four)));
}
