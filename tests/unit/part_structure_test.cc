// A part splits into its structure and one step's values and joins back to the same
// manifest; values that do not fit the structure are refused, naming the difference.
#include <catch2/catch.hpp>

#include <limits>

#include "common/status.h"
#include "format/part_structure.h"

using namespace ckpt::format;

namespace {

// Ranks 2 and 3 of a world of 4, one tensor with a chunked piece, a train-state entry.
Manifest Part(uint64_t step, const std::string& checksum) {
  Manifest m;
  m.job = "llm";
  m.step = step;
  m.unix_time = 1.5e9 + static_cast<double>(step);
  m.wall_time = "2026-11-22T06:00:00Z";
  m.world_size = 4;
  m.ckptd_version = "0.1.0";
  m.run = 7;
  m.checksum_chunk_bytes = 8;
  m.metadata = {{"loss", std::to_string(step)}};
  for (uint32_t r = 2; r < 4; ++r) {
    ManifestShard s;
    s.rank = r;
    s.file = ShardFileName(r);
    s.bytes = 100 + step + r;
    s.metadata = {{"seen", std::to_string(step * r)}};
    s.train_state["rng"] = {16, 24, checksum};
    m.shards.push_back(s);
    TensorShard piece{r, s.file, 0, 16, {2 * r, 0}, {2, 2}, checksum, {checksum, checksum}, {}};
    m.tensors["w"].dtype = "F32";
    m.tensors["w"].global_shape = {8, 2};
    m.tensors["w"].shards.push_back(piece);
  }
  return m;
}

}  // namespace

TEST_CASE("a part joins back from its structure and values") {
  Manifest part = Part(100, "xxh3:00000000000000ab");
  SplitResult split = SplitPart(part);
  CHECK(split.structure->checksums == 8);  // 2 pieces x (1 + 2 chunks) + 2 train-state entries
  CHECK(split.values.ranks.size() == 2);
  auto joined = JoinPart(*split.structure, split.values);
  REQUIRE(joined.ok());
  CHECK(ManifestToJson(*joined) == ManifestToJson(part));
}

TEST_CASE("packed tensors join back exactly: boxes, flat ranges, several tensors and ranks") {
  Manifest part = Part(100, "xxh3:00000000000000ab");
  // A flat piece (FSDP) on each rank, a 0-d tensor, and a piece with no offset (zeros).
  for (uint32_t r = 2; r < 4; ++r) {
    TensorShard flat{r, ShardFileName(r), 16, 48, {}, {8}, "xxh3:00000000000000cd", {}, {{4 * r, 4 * r + 4}, {32 + 4 * r, 36 + 4 * r}}};
    part.tensors["f"].dtype = "BF16";
    part.tensors["f"].global_shape = {8, 8};
    part.tensors["f"].shards.push_back(flat);
    part.tensors["scalar"].dtype = "I64";
    part.tensors["scalar"].shards.push_back({r, ShardFileName(r), 48, 56, {}, {}, "xxh3:00000000000000ef", {}, {}});
  }
  SplitResult split = SplitPart(part);
  CHECK(split.structure->structure.tensors.empty());  // packed instead
  REQUIRE(split.structure->tensors.tensors.size() == 3);
  CHECK(split.structure->tensors.holders.size() == 2);
  CHECK(split.structure->bytes() < ManifestToJson(part).size());
  auto joined = JoinPart(*split.structure, split.values);
  REQUIRE(joined.ok());
  CHECK(ManifestToJson(*joined) == ManifestToJson(part));
}

TEST_CASE("steps of the same structure share its digest; a changed structure does not") {
  SplitResult a = SplitPart(Part(100, "xxh3:00000000000000ab"));
  SplitResult b = SplitPart(Part(200, "xxh3:00000000000000cd"));
  CHECK(a.structure->digest == b.structure->digest);
  CHECK(a.values.xxh3 == std::vector<uint64_t>(8, 0xab));  // packed: 8 bytes each
  CHECK(a.values.checksums.empty());
  CHECK(a.values.xxh3 != b.values.xxh3);
  // Step 200's values on step 100's structure: step 200's part exactly.
  auto joined = JoinPart(*a.structure, b.values);
  REQUIRE(joined.ok());
  CHECK(ManifestToJson(*joined) == ManifestToJson(Part(200, "xxh3:00000000000000cd")));

  Manifest moved = Part(100, "xxh3:00000000000000ab");
  moved.tensors["w"].shards[0].end = 20;  // another byte range: another file layout
  CHECK(SplitPart(moved).structure->digest != a.structure->digest);
  Manifest renamed = Part(100, "xxh3:00000000000000ab");
  renamed.job = "other";
  CHECK(SplitPart(renamed).structure->digest != a.structure->digest);
}

TEST_CASE("values that do not fit a structure are refused") {
  SplitResult split = SplitPart(Part(100, "xxh3:00000000000000ab"));
  PartValues fewer = split.values;
  fewer.xxh3.pop_back();
  auto short_checksums = JoinPart(*split.structure, fewer);
  REQUIRE_FALSE(short_checksums.ok());
  CHECK_THAT(ckpt::Message(short_checksums.status()), Catch::Contains("7 checksums") && Catch::Contains("has 8"));
  PartValues more_ranks = split.values;
  more_ranks.ranks.emplace_back();
  auto extra = JoinPart(*split.structure, more_ranks);
  REQUIRE_FALSE(extra.ok());
  CHECK_THAT(ckpt::Message(extra.status()), Catch::Contains("values for 3 ranks"));
}

TEST_CASE("checksums not in ckptd's form travel as text, and join back the same") {
  Manifest part = Part(100, "made by hand");
  SplitResult split = SplitPart(part);
  CHECK(split.values.xxh3.empty());
  CHECK(split.values.checksums.size() == 8);
  auto joined = JoinPart(*split.structure, split.values);
  REQUIRE(joined.ok());
  CHECK(ManifestToJson(*joined) == ManifestToJson(part));
  // Upper-case hex is not what ckptd writes: text too, so that it joins back unchanged.
  CHECK(SplitPart(Part(100, "xxh3:00000000000000AB")).values.xxh3.empty());
  PartValues both = SplitPart(Part(100, "xxh3:00000000000000ab")).values;
  both.checksums.push_back("x");
  CHECK_FALSE(JoinPart(*split.structure, both).ok());
}

TEST_CASE("values that describe a file shorter than its entries, or no time, are refused") {
  SplitResult split = SplitPart(Part(100, "xxh3:00000000000000ab"));
  CHECK(split.structure->min_bytes == std::vector<uint64_t>{24, 24});  // train state ends at 24
  PartValues short_file = split.values;
  short_file.ranks[1].bytes = 20;
  CHECK_THAT(ckpt::Message(CheckValuesFit(*split.structure, short_file)),
             Catch::Contains("rank 3 holds 20 bytes, less than the end of its entries (24)"));
  PartValues no_time = split.values;
  no_time.unix_time = std::numeric_limits<double>::infinity();
  CHECK_THAT(ckpt::Message(CheckValuesFit(*split.structure, no_time)), Catch::Contains("is not a time"));
}

TEST_CASE("values whose checksums stayed on the node fit by their count, but cannot join back") {
  for (const char* checksum : {"xxh3:00000000000000ab", "made by hand"}) {
    SplitResult split = SplitPart(Part(100, checksum));
    PartValues counted = split.values.WithChecksumsWithheld();
    CHECK(counted.withheld == 8);
    CHECK(counted.xxh3.empty());
    CHECK(counted.checksums.empty());
    CHECK(counted.checksum_count() == 8);
    CHECK(counted.ranks.size() == split.values.ranks.size());
    CHECK(counted.metadata == split.values.metadata);
    CHECK(CheckValuesFit(*split.structure, counted).ok());
    auto joined = JoinPart(*split.structure, counted);
    REQUIRE_FALSE(joined.ok());
    CHECK_THAT(ckpt::Message(joined.status()), Catch::Contains("stayed on its node"));
    PartValues wrong_count = counted;
    wrong_count.withheld = 9;
    CHECK_THAT(ckpt::Message(CheckValuesFit(*split.structure, wrong_count)), Catch::Contains("9 checksums"));
    PartValues count_and_list = split.values;
    count_and_list.withheld = 8;
    CHECK_THAT(ckpt::Message(CheckValuesFit(*split.structure, count_and_list)), Catch::Contains("not more than one"));
  }
}
