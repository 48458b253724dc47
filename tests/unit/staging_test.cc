#include <catch2/catch.hpp>

#include <cstring>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "cuda/copy_engine.h"
#include "cuda/staging_pool.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt::cuda;

TEST_CASE("the staging pool hands out aligned blocks and refuses past its budget") {
  auto pool = StagingPool::Create(1 << 20, false);
  REQUIRE(pool.ok());
  auto a = (*pool)->Allocate(100);
  auto b = (*pool)->Allocate(600 << 10);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(reinterpret_cast<uintptr_t>((*a)->data()) % StagingPool::kAlignment == 0);
  CHECK((*pool)->used() == 4096 + (600 << 10));
  auto c = (*pool)->Allocate(600 << 10);
  CHECK(absl::IsResourceExhausted(c.status()));
  b->reset();
  CHECK((*pool)->used() == 4096);
  CHECK((*pool)->Allocate(600 << 10).ok());
}

TEST_CASE("freed blocks coalesce so a large block fits again") {
  auto pool = StagingPool::Create(64 << 12, true);
  REQUIRE(pool.ok());
  std::vector<StagingBlockPtr> blocks;
  for (int i = 0; i < 64; ++i) blocks.push_back(std::move(*(*pool)->Allocate(4096)));
  CHECK_FALSE((*pool)->Allocate(1).ok());
  for (int i = 0; i < 64; i += 2) blocks[i].reset();
  for (int i = 1; i < 64; i += 2) blocks[i].reset();
  CHECK((*pool)->used() == 0);
  CHECK((*pool)->Allocate(64 << 12).ok());
}

// Every copy engine must pass these; the CUDA engine joins the list when it exists.
struct HostEngine1 {
  static CopyEnginePtr Make() { return MakeHostCopyEngine(1); }
};
struct HostEngine4 {
  static CopyEnginePtr Make() { return MakeHostCopyEngine(4); }
};

TEMPLATE_TEST_CASE("copy engines copy every byte of every region", "[copy_engine]", HostEngine1,
                   HostEngine4) {
  CopyEnginePtr engine = TestType::Make();
  for (size_t size : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{1} << 20,
                      (size_t{3} << 20) + 7, (size_t{9} << 20) + 13}) {
    std::vector<uint8_t> src(size), dst(size, 0xEE);
    std::iota(src.begin(), src.end(), static_cast<uint8_t>(size));
    std::vector<uint8_t> src2(size / 2 + 3, 0x42), dst2(size / 2 + 3, 0);
    std::vector<CopyRegion> regions = {{dst.data(), src.data(), size},
                                       {dst2.data(), src2.data(), src2.size()}};
    REQUIRE(engine->Copy(regions).ok());
    CHECK(dst == src);
    CHECK(dst2 == src2);
  }
}

TEMPLATE_TEST_CASE("copy engines survive many small regions and repeated jobs", "[copy_engine]",
                   HostEngine1, HostEngine4) {
  CopyEnginePtr engine = TestType::Make();
  // Sizes straddle the per-thread split points (a few MiB in all).
  std::vector<std::vector<uint32_t>> src(1000), dst(1000);
  std::vector<CopyRegion> regions;
  for (size_t i = 0; i < src.size(); ++i) {
    src[i].assign((i % 17 + 1) * (i % 3 == 0 ? 997 : 1), static_cast<uint32_t>(i));
    dst[i].assign(src[i].size(), 0);
    regions.push_back({dst[i].data(), src[i].data(), src[i].size() * 4});
  }
  for (int round = 0; round < 20; ++round) REQUIRE(engine->Copy(regions).ok());
  CHECK(dst == src);
}

TEST_CASE("the pool is usable at once while it is pre-faulted in the background") {
  auto pool = StagingPool::Create(512u << 20, /*prefault=*/true);
  REQUIRE(pool.ok());
  auto block = (*pool)->Allocate(256u << 20);
  REQUIRE(block.ok());
  for (size_t off = 0; off < (256u << 20); off += 4096) (*block)->data()[off] = static_cast<char>(off >> 12);
  CHECK(ckpt::testing::WaitUntil([&] { return (*pool)->prefault_done(); }, std::chrono::seconds(5)));
  bool intact = true;
  for (size_t off = 0; off < (256u << 20); off += 4096) {
    intact &= (*block)->data()[off] == static_cast<char>(off >> 12);
  }
  CHECK(intact);  // populating never overwrote what was written meanwhile
}
