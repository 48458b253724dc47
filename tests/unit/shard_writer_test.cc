// The shard writer's two paths (O_DIRECT from aligned staging memory, and buffered where
// the filesystem refuses O_DIRECT) write the same valid safetensors file.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/status.h"
#include "cuda/staging_pool.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "daemon/persist/shard_writer.h"
#include "storage/local_store.h"
#include "format/shard_reader.h"
#include "tests/fakes/faulty_filesystem.h"
#include "tests/fakes/flip_bit.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt;
using namespace ckpt::persist;
using namespace ckpt::format;
using ckpt::daemon::StagingWatermark;

namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("a data region held in several places is written as the same file as one held in one") {
  // Entries of sizes that put every boundary off the 4 KiB block, the middle one (as a frozen
  // tensor is) in a block of its own, at an address congruent to its offset or not.
  const uint64_t a = (13u << 20) + 5, b = (9u << 20) + 3, c = 4096 + 7, bytes = a + b + c;
  auto pool = std::move(*cuda::StagingPool::Create(64 << 20, false));
  auto whole = std::move(*pool->Allocate(bytes));
  for (uint64_t i = 0; i < bytes; ++i) whole->data()[i] = static_cast<char>(i * 13 + (i >> 12));
  auto own = std::move(*pool->Allocate(a + c));
  std::memcpy(own->data(), whole->data(), a);
  std::memcpy(own->data() + a, whole->data() + a + b, c);
  for (uint64_t shift : {a % 4096, uint64_t{0}}) {
    auto frozen = std::move(*pool->Allocate(b + 4096));
    std::memcpy(frozen->data() + shift, whole->data() + a, b);
    StagedShard one, several;
    for (StagedShard* s : {&one, &several}) {
      s->rank = 1;
      s->data_bytes = bytes;
      s->entries = {{"a", "U8", {static_cast<int64_t>(a)}, 0, a},
                    {"b", "U8", {static_cast<int64_t>(b)}, a, a + b},
                    {"c", "U8", {static_cast<int64_t>(c)}, a + b, bytes}};
    }
    one.region = ScatteredBytes(whole->data(), bytes);
    several.region.Append(own->data(), a);
    several.region.Append(frozen->data() + shift, b);
    several.region.Append(own->data() + a, c);
    testing::TempDir one_dir, several_dir;
    auto fs = std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
    auto x = MakeShardWriter(storage::MakeLocalStore(fs, ""))->Write(one, one_dir.path());
    auto y = MakeShardWriter(storage::MakeLocalStore(fs, ""))->Write(several, several_dir.path());
    REQUIRE(x.ok());
    REQUIRE(y.ok());
    INFO("the frozen block's bytes " << shift << " bytes into it");
    CHECK(x->checksums == y->checksums);
    CHECK(x->chunk_checksums == y->chunk_checksums);
    CHECK(Slurp(one_dir / x->file) == Slurp(several_dir / y->file));
  }
}

TEST_CASE("direct and buffered shards are identical, aligned and valid") {
  for (uint64_t bytes : {uint64_t{4}, uint64_t{4096}, uint64_t{(40u << 20) + 12}, uint64_t{12345}}) {
    auto pool = std::move(*cuda::StagingPool::Create(64 << 20, false));
    auto block = std::move(*pool->Allocate(bytes));
    for (uint64_t i = 0; i < bytes; ++i) block->data()[i] = static_cast<char>(i * 7 + 3);
    StagedShard shard;
    shard.rank = 3;
    shard.region = ScatteredBytes(block->data(), bytes);
    shard.data_bytes = bytes;
    shard.entries = {{"a", "U8", {static_cast<int64_t>(bytes - 4)}, 0, bytes - 4},
                     {"b", "F32", {}, bytes - 4, bytes}};
    shard.metadata = {{"k", "v"}};

    testing::TempDir direct_dir, buffered_dir;
    auto direct_fs = std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
    auto buffered_fs = std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
    buffered_fs->DisableDirectIo();
    auto a = MakeShardWriter(storage::MakeLocalStore(direct_fs, ""))->Write(shard, direct_dir.path());
    auto b = MakeShardWriter(storage::MakeLocalStore(buffered_fs, ""))->Write(shard, buffered_dir.path());
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    INFO("bytes " << bytes);
    CHECK(a->file == "rank-00003.safetensors");
    CHECK(a->checksums == b->checksums);
    std::string fa = Slurp(direct_dir / a->file), fb = Slurp(buffered_dir / b->file);
    CHECK(fa.size() == a->bytes);
    CHECK(fa == fb);
    auto reader = ShardReader::Open(*storage::MakeLocalStore(direct_fs, ""), direct_dir / a->file, a->bytes);
    REQUIRE(reader.ok());
    CHECK((*reader)->header().data_start % 4096 == 0);
    std::string got(bytes - 4, '\0');
    CHECK((*reader)->ReadEntry(*(*reader)->Find("a"), got.data(), a->checksums.at("a")).ok());
    CHECK(got == std::string(block->data(), bytes - 4));
  }
}

TEST_CASE("a full disk during an O_DIRECT write is reported with the file named") {
  auto pool = std::move(*cuda::StagingPool::Create(64 << 20, false));
  auto block = std::move(*pool->Allocate(40 << 20));
  StagedShard shard;
  shard.region = ScatteredBytes(block->data(), 40 << 20);
  shard.data_bytes = 40 << 20;
  shard.entries = {{"w", "U8", {40 << 20}, 0, 40 << 20}};
  testing::TempDir dir;
  auto fs = std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
  fs->FailAfter(testing::FaultyFilesystem::Op::kWrite, 1, ENOSPC);
  auto r = MakeShardWriter(storage::MakeLocalStore(fs, ""))->Write(shard, dir.path());
  CHECK(absl::IsResourceExhausted(r.status()));
  CHECK(Message(r.status()).find("rank-00000.safetensors") != std::string::npos);
}

// The writer streams what has landed while the rest is still being copied, and never
// reads past the watermark: bytes beyond it hold garbage until the "copy" puts the real
// ones there, and the file and checksums must still be exactly the real bytes.
TEST_CASE("a shard is written chunk by chunk as its data lands") {
  for (bool direct : {true, false}) {
    INFO((direct ? "O_DIRECT" : "buffered"));
    constexpr uint64_t kBytes = (100u << 20) + 1000;  // four writer chunks and a ragged tail
    auto pool = std::move(*cuda::StagingPool::Create(128 << 20, false));
    auto block = std::move(*pool->Allocate(kBytes));
    std::string real(kBytes, '\0');
    for (uint64_t i = 0; i < kBytes; ++i) real[i] = static_cast<char>(i * 13 + 5);
    std::memset(block->data(), 0xEE, kBytes);  // garbage until "copied"
    StagingWatermark landed;
    StagedShard shard;
    shard.rank = 0;
    shard.region = ScatteredBytes(block->data(), kBytes);
    shard.data_bytes = kBytes;
    // Entries straddle the writer's chunks; an empty one sits at the end.
    shard.entries = {{"a", "U8", {50 << 20}, 0, 50u << 20},
                     {"b", "U8", {static_cast<int64_t>(kBytes - (50u << 20))}, 50u << 20, kBytes},
                     {"empty", "U8", {0}, kBytes, kBytes}};
    shard.landed = &landed;

    testing::TempDir dir;
    auto fs = std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
    if (!direct) fs->DisableDirectIo();
    auto writer = MakeShardWriter(storage::MakeLocalStore(fs, ""));
    absl::StatusOr<WrittenShard> written;
    std::thread writing([&] { written = writer->Write(shard, dir.path()); });

    uint64_t done = 0;
    auto land = [&](uint64_t upto) {
      std::memcpy(block->data() + done, real.data() + done, upto - done);
      done = upto;
      landed.Advance(upto);
    };
    land(40u << 20);
    // The first 32 MiB chunk goes out while 60 MiB are still to come.
    CHECK(ckpt::testing::WaitUntil([&] { return fs->bytes_written() >= (32u << 20); },
                                   std::chrono::seconds(10)));
    CHECK(fs->bytes_written() < (64u << 20));
    land(90u << 20);
    land(kBytes);
    writing.join();
    REQUIRE(written.ok());
    CHECK(written->checksums.at("a") == ChecksumOf(real.data(), 50u << 20));
    CHECK(written->checksums.at("b") == ChecksumOf(real.data() + (50u << 20), kBytes - (50u << 20)));
    CHECK(written->checksums.at("empty") == ChecksumOf(nullptr, 0));
    std::string file = Slurp(dir / written->file);
    REQUIRE(file.size() == written->bytes);
    CHECK(file.compare(file.size() - kBytes, kBytes, real) == 0);
  }
}

TEST_CASE("a failed copy stops the writer with the copy's error") {
  auto pool = std::move(*cuda::StagingPool::Create(64 << 20, false));
  auto block = std::move(*pool->Allocate(40u << 20));
  StagingWatermark landed;
  StagedShard shard;
  shard.region = ScatteredBytes(block->data(), 40u << 20);
  shard.data_bytes = 40u << 20;
  shard.entries = {{"a", "U8", {40 << 20}, 0, 40u << 20}};
  shard.landed = &landed;
  testing::TempDir dir;
  auto writer = MakeShardWriter(storage::MakeLocalStore(std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem()), ""));
  absl::StatusOr<WrittenShard> written;
  std::thread writing([&] { written = writer->Write(shard, dir.path()); });
  landed.Advance(33u << 20);
  landed.Fail("cudaMemcpyAsync: an illegal memory access was encountered (tensor w)");
  writing.join();
  REQUIRE(!written.ok());
  CHECK_THAT(Message(written.status()),
             Catch::Contains("staging copy failed: cudaMemcpyAsync: an illegal memory access") &&
                 Catch::Contains("rank-00000.safetensors"));
}

TEST_CASE("entries longer than a chunk get a checksum per chunk; a range read checks only its chunks") {
  constexpr uint64_t kChunk = kChecksumChunkBytes;
  const uint64_t big = 2 * kChunk + 12345;  // three chunks, the last one short
  const uint64_t bytes = big + 4096;
  auto pool = std::move(*cuda::StagingPool::Create(64 << 20, false));
  auto block = std::move(*pool->Allocate(bytes));
  for (uint64_t i = 0; i < bytes; ++i) block->data()[i] = static_cast<char>(i * 13 + 1);
  StagedShard shard;
  shard.region = ScatteredBytes(block->data(), bytes);
  shard.data_bytes = bytes;
  shard.entries = {{"big", "U8", {static_cast<int64_t>(big)}, 0, big},
                   {"small", "U8", {4096}, big, bytes}};
  testing::TempDir dir;
  auto fs = std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
  auto written = MakeShardWriter(storage::MakeLocalStore(fs, ""))->Write(shard, dir.path());
  REQUIRE(written.ok());
  const std::vector<std::string>& chunks = written->chunk_checksums.at("big");
  REQUIRE(chunks.size() == 3);
  CHECK(chunks[0] == ChecksumOf(block->data(), kChunk));
  CHECK(chunks[2] == ChecksumOf(block->data() + 2 * kChunk, big - 2 * kChunk));
  CHECK(written->chunk_checksums.count("small") == 0);  // its whole checksum says it all

  auto reader = std::move(*ShardReader::Open(*storage::MakeLocalStore(fs, ""), dir / written->file, written->bytes));
  const TensorEntry& entry = *reader->Find("big");
  ShardReader::Checksums sums{written->checksums.at("big"), chunks, kChunk};
  auto read = [&](uint64_t from, uint64_t to, std::string& got, uint64_t& pread) {
    got.assign(to - from, '\0');
    pread = 0;
    return reader->ReadRange(entry, sums, from, to,
                             [&](uint64_t at, const char* data, uint64_t n) {
                               std::memcpy(got.data() + (at - from), data, n);
                             },
                             &pread);
  };
  std::string got;
  uint64_t pread = 0;
  // A range inside the second chunk reads that chunk alone.
  REQUIRE(read(kChunk + 100, kChunk + 5000, got, pread).ok());
  CHECK(got == std::string(block->data() + kChunk + 100, 4900));
  CHECK(pread == kChunk);
  // Across a boundary: both chunks.
  REQUIRE(read(kChunk - 10, kChunk + 10, got, pread).ok());
  CHECK(got == std::string(block->data() + kChunk - 10, 20));
  CHECK(pread == 2 * kChunk);

  // One flipped bit in the third chunk: ranges that avoid it still read; those that touch
  // it fail, naming the tensor, the file and the chunk's bytes.
  testing::FlipDataBit(dir / written->file, 2 * kChunk + 7, 0x20);
  CHECK(read(0, 2 * kChunk, got, pread).ok());
  absl::Status damaged = read(2 * kChunk - 1, 2 * kChunk + 1, got, pread);
  CHECK(damaged.code() == absl::StatusCode::kDataLoss);
  CHECK(Message(damaged).find(fmt::format("tensor big in {}: checksum mismatch in bytes [{}, {})",
                                          dir / written->file, 2 * kChunk, big)) != std::string::npos);
  // Without chunk checksums (a manifest from before them) the whole entry is checked.
  std::vector<std::string> none;
  ShardReader::Checksums whole{written->checksums.at("big"), none, 0};
  CHECK(reader->ReadRange(entry, whole, 0, 10, [](uint64_t, const char*, uint64_t) {}).code() ==
        absl::StatusCode::kDataLoss);
}
