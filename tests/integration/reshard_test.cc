// Restoring with another world size and placement (issue 11): a step saved by 4 ranks
// restores with 1, 2, 3 (uneven) and 8 ranks, row shards as column shards and back, from
// the daemon's memory and from disk, bit for bit against the global tensors; real ckptd,
// real trainer processes (tests/integration/reshard_helper.cc) with the C++ client. With
// --increments on, a chain (a full step, then increments referencing it) restores the same
// way, from memory (the hot copy) and from disk.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

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
                     const std::string& source, std::vector<std::string> args = {}) {
  for (const char* a : {"--layout", layout.c_str(), "check", "--saved-world-size", "4"}) args.push_back(a);
  for (const RunResult& r : ReshardRanks(d, dir, world, args)) {
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
  std::string file = ShardPath(d.root() + "/reshard/step-00000005", 0);
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
    CHECK(Contains(r.out, std::filesystem::path(file).filename().string() + ": checksum mismatch in bytes [8388608, "));
  }
}

TEST_CASE("with --increments on, a chain saved by 4 ranks restores with 1, 3 and 8 ranks in any placement, "
          "from memory and disk") {
  TempDir dir;
  Daemon d(dir, {"--increments", "on", "--increment-chunk-bytes", "64K", "--keep-last", "2"});
  d.Start();
  // Steps 1 (full), 3 and 5: 20 rows of both 2-D tensors change from step to step (rows of
  // 16 KiB chunks for layer0, by rows; of 64 for layer1, by columns).
  const std::vector<std::string> changing = {"--rows", "3001", "--changed-rows", "20"};
  std::vector<std::string> save = changing;
  for (const char* a : {"--layout", "rows", "save", "--steps-list", "1,3,5"}) save.push_back(a);
  for (const RunResult& r : ReshardRanks(d, dir, 4, save)) {
    INFO(r.out << r.err << d.Log());
    REQUIRE(r.exit_code == 0);
    REQUIRE(Contains(r.out, "saved committed"));
  }
  // 5 is an increment of every rank: most of its bytes are step 1's, some step 3's; 1 is
  // retired (--keep-last 2) but held.
  std::ifstream in(d.root() + "/reshard/step-00000005/manifest.json");
  const nlohmann::json m = nlohmann::json::parse(in, nullptr, false);
  REQUIRE_FALSE(m.is_discarded());
  CHECK(m["format_version"] == 5);
  const uint64_t own = m["increment"]["own_bytes"], referenced = m["increment"]["referenced_bytes"];
  INFO("own " << own << ", referenced " << referenced);
  CHECK(referenced > 8 * own);
  CHECK(m["increment"]["origin_steps"].size() == 2);
  auto verified = d.Ctl({"--job", "reshard", "verify", "5"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(Contains(verified.out, ".held-"));  // step 1's files, read where retention moved them
  // The hot copy holds step 5 whole: other placements read it through the planner.
  RestoresExactly(d, dir, 3, "cols", "memory", changing);
  RestoresExactly(d, dir, 8, "rows", "memory", changing);
  RestoresExactly(d, dir, 2, "flat", "memory", changing);
  REQUIRE(d.Stop() == 0);
  d.Start();
  // From disk, through the references.
  RestoresExactly(d, dir, 1, "rows", "disk", changing);
  RestoresExactly(d, dir, 3, "cols", "disk", changing);
  RestoresExactly(d, dir, 8, "flat", "disk", changing);
  RestoresExactly(d, dir, 4, "rows", "disk", changing);  // as saved
}
