#include <catch2/catch.hpp>

#include <map>
#include <vector>

#include "cuda/chunk_plan.h"

using namespace ckpt::cuda;

TEST_CASE("every byte is planned exactly once, spread over every stream") {
  std::vector<char> a(1000), b(10), c(0), da(1000), db(10), dc(0);
  std::vector<CopyRegion> regions = {{da.data(), a.data(), a.size()},
                                     {db.data(), b.data(), b.size()},
                                     {dc.data(), c.data(), c.size()}};
  auto plan = PlanChunks(regions, 4, 128);
  REQUIRE(plan.size() == 4);
  std::map<const char*, size_t> covered;  // src byte -> times planned
  for (const auto& stream : plan) {
    CHECK_FALSE(stream.empty());
    for (const CopyRegion& chunk : stream) {
      CHECK(chunk.bytes <= 128);
      // Each chunk keeps its offset: source and destination move together.
      bool same_offset =
          static_cast<const char*>(chunk.src) - a.data() == static_cast<char*>(chunk.dst) - da.data() ||
          static_cast<const char*>(chunk.src) - b.data() == static_cast<char*>(chunk.dst) - db.data();
      CHECK(same_offset);
      for (size_t i = 0; i < chunk.bytes; ++i) covered[static_cast<const char*>(chunk.src) + i]++;
    }
  }
  CHECK(covered.size() == 1010);
  for (const auto& [byte, times] : covered) CHECK(times == 1);
}

TEST_CASE("degenerate stream counts and chunk sizes are clamped") {
  std::vector<char> a(10), d(10);
  CopyRegion r{d.data(), a.data(), a.size()};
  CHECK(PlanChunks({&r, 1}, 0, 0).size() == 1);
  CHECK(PlanChunks({&r, 1}, 0, 0)[0].size() == 10);
  CHECK(PlanChunks({}, 3, 64).size() == 3);
}
