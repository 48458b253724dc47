// Restoring with another world size and placement (issue 11): a step saved by 4 ranks
// restores with 1, 2, 3 (uneven) and 8 ranks, row shards as column shards and back, from
// the daemon's memory and from disk, bit for bit against the global tensors; real ckptd,
// real trainer processes (tests/integration/reshard_helper.cc) with the C++ client.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>

#include "tests/fakes/flip_bit.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;

namespace {

void SaveWithFourRanks(const Daemon& d, const TempDir& dir, const std::string& rows = "3001",
                       const std::string& layout = "rows") {
  for (const RunResult& r :
       ReshardRanks(d, dir, 4, {"--rows", rows, "--layout", layout, "save", "--wait-committed"})) {
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    REQUIRE(Contains(r.out, "saved committed"));
  }
}

void RestoresExactly(const Daemon& d, const TempDir& dir, uint32_t world, const std::string& layout,
                     const std::string& source) {
  for (const RunResult& r :
       ReshardRanks(d, dir, world, {"--layout", layout, "check", "--saved-world-size", "4"})) {
    INFO(world << " ranks, " << layout << ": " << r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, "restored step=5 source=" + source));
    CHECK(Contains(r.out, "match"));
  }
}

}  // namespace

TEST_CASE("FSDP flat shards restore as rows and columns, and row shards as flat shards") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveWithFourRanks(d, dir, "3001", "flat");  // rank 1's slice holds layer0's end and layer1's start
  auto verified = d.Ctl({"--job", "reshard", "verify", "5"});  // flat pieces, read through the planner
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  RestoresExactly(d, dir, 4, "flat", "memory");  // as saved: its own snapshot
  RestoresExactly(d, dir, 3, "rows", "memory");
  RestoresExactly(d, dir, 8, "flat", "memory");
  REQUIRE(d.Stop() == 0);
  d.Start();
  RestoresExactly(d, dir, 2, "cols", "disk");
  RestoresExactly(d, dir, 3, "flat", "disk");
  RestoresExactly(d, dir, 4, "flat", "disk");

  // And the reverse: row and column shards saved, flat shards restored.
  TempDir other;
  Daemon e(other);
  e.Start();
  SaveWithFourRanks(e, other);
  RestoresExactly(e, other, 3, "flat", "memory");
  REQUIRE(e.Stop() == 0);
  e.Start();
  RestoresExactly(e, other, 8, "flat", "disk");
  RestoresExactly(e, other, 1, "flat", "disk");
}

TEST_CASE("4 ranks' step restores with 1, 2, 3 and 8 ranks in either placement, from memory and disk") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveWithFourRanks(d, dir);
  // The node still holds all four snapshots: every piece comes from memory.
  RestoresExactly(d, dir, 1, "rows", "memory");
  RestoresExactly(d, dir, 3, "cols", "memory");
  RestoresExactly(d, dir, 8, "rows", "memory");
  REQUIRE(d.Stop() == 0);
  d.Start();
  RestoresExactly(d, dir, 1, "cols", "disk");
  RestoresExactly(d, dir, 2, "rows", "disk");
  RestoresExactly(d, dir, 3, "rows", "disk");
  RestoresExactly(d, dir, 8, "cols", "disk");
  RestoresExactly(d, dir, 4, "cols", "disk");  // the saved world size, the other placement
  RestoresExactly(d, dir, 4, "rows", "disk");  // as saved
}

TEST_CASE("a resharding restore names what does not fit and catches a flipped bit in a chunk") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  // 12289 rows of 4 KiB: each rank's piece of layer0 is 12 MiB, two checksum chunks.
  SaveWithFourRanks(d, dir, "12289");
  // Another global shape: refused, naming the tensor and both shapes.
  for (const RunResult& r : ReshardRanks(d, dir, 2, {"--rows", "12288", "--layout", "rows", "check",
                                                 "--saved-world-size", "4"})) {
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(Contains(r.out, "layer0.weight: global shape [12289, 1024] saved, [12288, 1024] wanted"));
  }
  REQUIRE(d.Stop() == 0);
  // One bit 9 MiB into rank 0's data: its layer0 entry, second chunk.
  std::string file = d.root() + "/reshard/step-00000005/rank-00000.safetensors";
  FlipDataBit(file, 9 << 20);
  d.Start();
  // Eight ranks by rows: ranks 0 and 1 split rank 0's saved rows, and only rank 1's half
  // covers the damaged chunk. The step is damaged for every rank (nothing older exists),
  // named by the chunk's byte range.
  auto ranks = ReshardRanks(d, dir, 8, {"--rows", "12289", "--layout", "rows", "check",
                                    "--saved-world-size", "4"});
  for (const RunResult& r : ranks) {
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(Contains(r.out, "every committed step is damaged"));
    CHECK(Contains(r.out, "rank 1: tensor layer0.weight in "));
    CHECK(Contains(r.out, "rank-00000.safetensors: checksum mismatch in bytes [8388608, "));
  }
}
