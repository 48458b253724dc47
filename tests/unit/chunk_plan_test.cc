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

TEST_CASE("regions adjacent on both sides are copied as one; any gap keeps them apart") {
  std::vector<char> src(1000), dst(2000);
  // Four 100-byte tensors laid out back to back on both sides, then one with a gap in the
  // destination (staging alignment), then one with a gap in the source.
  const void* one = src.data();  // the allocation's identity
  std::vector<CopyRegion> regions;
  for (int i = 0; i < 4; ++i) regions.push_back({dst.data() + 100 * i, src.data() + 100 * i, 100, one});
  regions.push_back({dst.data() + 464, src.data() + 400, 100, one});
  regions.push_back({dst.data() + 564, src.data() + 600, 100, one});
  regions.push_back({dst.data() + 664, src.data() + 700, 0, one});  // empty: dropped
  auto merged = CoalesceRegions(regions);
  REQUIRE(merged.size() == 3);
  CHECK(merged[0].dst == dst.data());
  CHECK(merged[0].bytes == 400);
  CHECK(merged[1].src == src.data() + 400);
  CHECK(merged[2].src == src.data() + 600);
  // Chunking still cuts the merged region at chunk_bytes.
  auto plan = PlanChunks(regions, 2, 256);
  size_t chunks = 0, bytes = 0;
  for (const auto& stream : plan) {
    for (const CopyRegion& c : stream) {
      CHECK(c.bytes <= 256);
      ++chunks;
      bytes += c.bytes;
    }
  }
  CHECK(chunks == 4);  // 256 + 144, 100, 100
  CHECK(bytes == 600);
}

TEST_CASE("regions of different allocations, or of none, are never merged, adjacent or not") {
  std::vector<char> src(400), dst(400);
  int a = 0, b = 0;
  std::vector<CopyRegion> regions = {{dst.data(), src.data(), 100, &a},
                                     {dst.data() + 100, src.data() + 100, 100, &b},  // another allocation
                                     {dst.data() + 200, src.data() + 200, 100, nullptr},  // host memory
                                     {dst.data() + 300, src.data() + 300, 100, nullptr}};
  CHECK(CoalesceRegions(regions).size() == 4);
}

TEST_CASE("neighbours listed out of order (a restore lists tensors by name) are still merged") {
  std::vector<char> src(1000), dst(1000);
  const void* one = src.data();
  std::vector<CopyRegion> regions;
  // b0, b1, b10, b2, ..., b9 of 100 bytes each: by name, not by address.
  for (int i : {0, 1, 9, 2, 3, 4, 5, 6, 7, 8}) {
    regions.push_back({dst.data() + 100 * i, src.data() + 100 * i, 100, one});
  }
  auto merged = CoalesceRegions(regions);
  REQUIRE(merged.size() == 1);
  CHECK(merged[0].dst == dst.data());
  CHECK(merged[0].src == src.data());
  CHECK(merged[0].bytes == 1000);
}
