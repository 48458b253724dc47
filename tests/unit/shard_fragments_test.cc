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
#include "daemon/replicate/shard_fragments.h"

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
