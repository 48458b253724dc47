// A shard as k + m fragments and back (issue 25): any k rebuild it bit for bit, a damaged one
// is left out for another, and the peers that hold them survive any m nodes lost.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "daemon/replicate/fragment_checksum.h"
#include "daemon/replicate/shard_fragments.h"
#include "format/checksum.h"

using namespace ckpt::replicate;

namespace {

std::vector<uint8_t> Data(size_t n) {
  std::vector<uint8_t> d(n);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : d) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  return d;
}

std::vector<std::shared_ptr<const HeldFragment>> Shared(const std::vector<HeldFragment>& fragments,
                                                        const std::vector<int>& indices) {
  std::vector<std::shared_ptr<const HeldFragment>> out;
  for (int i : indices) out.push_back(std::make_shared<const HeldFragment>(fragments[static_cast<size_t>(i)]));
  return out;
}

}  // namespace

TEST_CASE("a shard coded 4+2 is rebuilt bit for bit from any 4 of its 6 fragments") {
  const std::vector<uint8_t> data = Data((1 << 20) + 13);
  auto code = ErasureCode::Make(4, 2);
  REQUIRE(code.ok());
  auto fragments = CodeShard(*code, "llm", 1200, 3, 25, 77, data, 2);
  REQUIRE(fragments.ok());
  REQUIRE(fragments->size() == 6);
  CHECK(fragments->at(5).id.index == 5);
  CHECK(fragments->at(5).id.rank == 25);
  CHECK(fragments->at(5).meta.data_bytes == data.size());
  for (int mask = 0; mask < 64; ++mask) {
    std::vector<int> chosen;
    for (int i = 0; i < 6; ++i) {
      if (mask & (1 << i)) chosen.push_back(i);
    }
    if (chosen.size() != 4) continue;
    auto rebuilt = RebuildShard(Shared(*fragments, chosen));
    INFO("fragments " << mask);
    REQUIRE(rebuilt.ok());
    CHECK(std::equal(rebuilt->begin(), rebuilt->end(), data.begin(), data.end(),
                     [](char a, uint8_t b) { return static_cast<uint8_t>(a) == b; }));
  }
}

TEST_CASE("a fragment that fails its checksum is left out, and another used where there is one") {
  const std::vector<uint8_t> data = Data(100'000);
  auto code = ErasureCode::Make(2, 1);
  REQUIRE(code.ok());
  auto fragments = CodeShard(*code, "llm", 7, 0, 1, 1, data);
  REQUIRE(fragments.ok());
  fragments->at(0).bytes[10] ^= 0x40;  // damaged in a peer's memory, or on the way
  auto rebuilt = RebuildShard(Shared(*fragments, {0, 1, 2}));
  REQUIRE(rebuilt.ok());
  CHECK(std::string(data.begin(), data.end()) == *rebuilt);
  auto short_of = RebuildShard(Shared(*fragments, {0, 2}));
  CHECK(absl::IsDataLoss(short_of.status()));
  CHECK_THAT(ckpt::Message(short_of.status()),
             Catch::Contains("rank 1's shard of job llm step 7 (node 0's): 1 usable fragments of the 2 needed "
                             "(1 failed their checksum)"));
  auto other = CodeShard(*code, "llm", 8, 0, 1, 1, data);
  REQUIRE(other.ok());
  auto mixed = Shared(*fragments, {1});
  mixed.push_back(std::make_shared<const HeldFragment>(other->at(2)));
  CHECK(absl::IsInvalidArgument(RebuildShard(mixed).status()));
  CHECK(absl::IsNotFound(RebuildShard({}).status()));
}

TEST_CASE("1+1 is a plain mirror: the one peer's fragment is the shard") {
  const std::vector<uint8_t> data = Data(4096 + 5);
  auto code = ErasureCode::Make(1, 1);
  REQUIRE(code.ok());
  auto fragments = CodeShard(*code, "j", 1, 0, 0, 1, data);
  REQUIRE(fragments.ok());
  auto holders = FragmentHolders({{0, 1}, {}}, 0, 1, 1);
  REQUIRE(holders.ok());
  CHECK(*holders == std::vector<uint32_t>{1});
  auto rebuilt = RebuildShard(Shared(*fragments, {0}));
  REQUIRE(rebuilt.ok());
  CHECK(std::string(data.begin(), data.end()) == *rebuilt);
}

TEST_CASE("the peers holding a node's fragments survive any m nodes lost, the node among them") {
  for (auto [k, m, size] : std::vector<std::tuple<int, int, uint32_t>>{{2, 1, 3}, {4, 2, 6}, {4, 2, 7}, {3, 3, 6}}) {
    CodingGroup group;
    for (uint32_t n = 0; n < size; ++n) group.nodes.push_back(10 + n);
    for (uint32_t owner : group.nodes) {
      auto holders = FragmentHolders(group, owner, k, m);
      REQUIRE(holders.ok());
      REQUIRE(holders->size() == static_cast<size_t>(k + m - 1));
      CHECK(std::set<uint32_t>(holders->begin(), holders->end()).size() == holders->size());  // one each
      CHECK(std::find(holders->begin(), holders->end(), owner) == holders->end());
      // Every set of m lost nodes that includes the owner leaves k fragments.
      for (uint32_t mask = 0; mask < (1u << size); ++mask) {
        if (static_cast<int>(__builtin_popcount(mask)) != m || !(mask & (1u << (owner - 10)))) continue;
        int left = 0;
        for (uint32_t h : *holders) left += (mask & (1u << (h - 10))) ? 0 : 1;
        INFO(k << "+" << m << " in " << size << ", owner " << owner << ", lost " << mask);
        CHECK(left >= k);
      }
    }
  }
  CHECK(*FragmentHolders({{0, 1, 2, 3, 4, 5}, {}}, 2, 4, 2) == std::vector<uint32_t>{3, 4, 5, 0, 1});
  CHECK(absl::IsInvalidArgument(FragmentHolders({{0, 1, 2}, {}}, 7, 2, 1).status()));
  CHECK(absl::IsInvalidArgument(FragmentHolders({{0, 1}, {}}, 0, 2, 1).status()));
  CHECK(absl::IsInvalidArgument(FragmentHolders({{0, 1}, {}}, 0, 2, 0).status()));
}

namespace {

// Fragment `f` of the base step with `patch`'s changed chunks written over: what a holder builds.
std::string Applied(const HeldFragment& base, const ShardPatch& patch, size_t index) {
  std::string out = base.bytes;
  const size_t c_bytes = patch.sums.chunk_bytes;
  size_t from = 0;
  for (uint32_t c : patch.chunks) {
    const size_t at = c * c_bytes;
    const size_t n = std::min(c_bytes, out.size() - at);
    out.replace(at, n, patch.fragments[index].bytes, from, n);
    from += n;
  }
  REQUIRE(from == patch.fragments[index].bytes.size());
  return out;
}

}  // namespace

TEST_CASE("a shard coded as a patch of the step before gives, applied, every fragment of the new shard bit for bit") {
  for (auto [k, m] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 2}}) {
    auto code = ErasureCode::Make(k, m);
    REQUIRE(code.ok());
    const size_t count = static_cast<size_t>(k + m - 1);  // what the owner sends
    // Chunks of 4 KiB here, so that a shard of ~1 MiB has many; unaligned sizes.
    constexpr size_t kChunk = 4096;
    for (size_t bytes : {size_t{1000}, size_t{(1 << 20) + 13}, size_t{3 * 4096 * 4 + 100}}) {
      const std::vector<uint8_t> before = Data(bytes);
      auto old = CodeShard(*code, "j", 5, 2, 0, 9, before);
      REQUIRE(old.ok());
      const FragmentSums base = SumsOf(*old, count, kChunk, 2);
      REQUIRE(base.sums.size() == count);
      const size_t each = code->FragmentBytes(bytes);
      const size_t chunks = (each + kChunk - 1) / kChunk;
      // The base's sums are its fragments' chunked checksums.
      for (size_t i = 0; i < count; ++i) {
        CHECK(ChecksumMatches((*old)[i].bytes.data(), (*old)[i].bytes.size(), ChunkedChecksum(base.sums[i], kChunk)));
      }
      struct Change {
        const char* what;
        std::vector<size_t> at;  // shard bytes changed
      };
      for (const Change& change : std::vector<Change>{
               {"nothing", {}},
               {"the first byte", {0}},
               {"the last byte", {bytes - 1}},
               {"a byte in the middle and one near the end", {bytes / 2, bytes - 200}},
               {"every byte", {}}}) {
        std::vector<uint8_t> after = before;
        for (size_t at : change.at) after[at] ^= 0x5a;
        const bool every = std::string(change.what) == "every byte";
        if (every) {
          for (auto& b : after) b = static_cast<uint8_t>(b + 1);
        }
        INFO(k << "+" << m << ", " << bytes << " bytes, changed: " << change.what);
        auto patch = CodePatch(*code, "j", 6, 2, 0, 9, after, count, base, 2);
        INFO(patch.status());
        REQUIRE(patch.ok());
        auto full = CodeShard(*code, "j", 6, 2, 0, 9, after);
        REQUIRE(full.ok());
        // Only the chunks where a byte changed (every data fragment's column chunk) are sent.
        std::set<uint32_t> expected;
        for (size_t at : change.at) expected.insert(static_cast<uint32_t>(at % each / kChunk));
        if (every) {
          for (size_t c = 0; c < chunks; ++c) expected.insert(static_cast<uint32_t>(c));
        }
        CHECK(std::set<uint32_t>(patch->chunks.begin(), patch->chunks.end()) == expected);
        REQUIRE(patch->fragments.size() == count);
        const FragmentSums whole_sums = SumsOf(*full, count, kChunk);
        CHECK(patch->sums.sums == whole_sums.sums);
        for (size_t i = 0; i < count; ++i) {
          INFO("fragment " << i);
          const HeldFragment& f = patch->fragments[i];
          CHECK(f.id == FragmentId{"j", 6, 2, 0, static_cast<uint32_t>(i)});
          CHECK(f.meta.k == static_cast<uint32_t>(k));
          CHECK(f.meta.data_bytes == bytes);
          CHECK(f.meta.run == 9);
          CHECK(f.bytes.size() <= expected.size() * kChunk);
          const std::string applied = Applied((*old)[i], *patch, i);
          CHECK(applied == (*full)[i].bytes);
          // Its chunked checksum holds over the whole new fragment, and over the old one only
          // where that fragment's bytes did not change (a data fragment beside a changed one).
          CHECK(ChecksumMatches(applied.data(), applied.size(), f.meta.checksum));
          CHECK(ChecksumMatches((*old)[i].bytes.data(), (*old)[i].bytes.size(), f.meta.checksum) ==
                ((*old)[i].bytes == (*full)[i].bytes));
        }
        // The new fragments rebuild the new shard, patched ones among them.
        std::vector<std::shared_ptr<const HeldFragment>> held;
        for (size_t i = 0; i < count; ++i) {
          HeldFragment f = patch->fragments[i];
          f.bytes = Applied((*old)[i], *patch, i);
          held.push_back(std::make_shared<const HeldFragment>(std::move(f)));
        }
        if (held.size() >= static_cast<size_t>(k)) {
          auto rebuilt = RebuildShard(held);
          REQUIRE(rebuilt.ok());
          CHECK(*rebuilt == std::string(after.begin(), after.end()));
        }
      }
    }
  }
}

TEST_CASE("a patch is refused against sums of another coding, size or count") {
  auto code = ErasureCode::Make(2, 1);
  REQUIRE(code.ok());
  const std::vector<uint8_t> data = Data(100'000);
  auto old = CodeShard(*code, "j", 5, 2, 0, 9, data);
  REQUIRE(old.ok());
  const FragmentSums base = SumsOf(*old, 2, 4096);
  CHECK(CodePatch(*code, "j", 6, 2, 0, 9, data, 2, base).ok());
  CHECK(absl::IsInvalidArgument(CodePatch(*code, "j", 6, 2, 0, 9, Data(200'000), 2, base).status()));
  CHECK(absl::IsInvalidArgument(CodePatch(*code, "j", 6, 2, 0, 9, data, 3, base).status()));
  auto other = ErasureCode::Make(4, 2);
  REQUIRE(other.ok());
  CHECK(absl::IsInvalidArgument(CodePatch(*other, "j", 6, 2, 0, 9, data, 2, base).status()));
}

TEST_CASE("a fragment's checksum in either form: matched over its bytes, malformed ones never match") {
  const std::vector<uint8_t> d = Data(10'000);
  const std::string whole = ckpt::format::ChecksumOf(d.data(), d.size());
  CHECK(ChecksumMatches(d.data(), d.size(), whole));
  const std::string chunked = ChunkedChecksum(ChunkSums(d.data(), d.size(), 1024), 1024);
  CHECK(chunked.rfind("xxh3c:1024:", 0) == 0);
  CHECK(ChecksumMatches(d.data(), d.size(), chunked));
  CHECK(ChecksumLike(d.data(), d.size(), chunked) == chunked);
  std::vector<uint8_t> changed = d;
  changed[9'999] ^= 1;
  CHECK_FALSE(ChecksumMatches(changed.data(), changed.size(), whole));
  CHECK_FALSE(ChecksumMatches(changed.data(), changed.size(), chunked));
  for (const char* bad : {"", "xxh3:", "xxh3c:1024:", "xxh3c:100:0123456789abcdef", "xxh3c:0:0123456789abcdef",
                          "xxh3c:x:0123456789abcdef", "md5:0123456789abcdef", "xxh3c:1024:0123456789abcdeg"}) {
    INFO(bad);
    CHECK_FALSE(ChecksumMatches(d.data(), d.size(), bad));
  }
}
