// A part splits into its structure and one step's values and joins back to the same
// manifest; values that do not fit the structure are refused, naming the difference.
#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <vector>

#include "common/status.h"
#include "format/part_structure.h"
#include "tests/fakes/increment_chain.h"
#include "tests/fakes/temp_dir.h"

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

namespace {

using ckpt::testing::IncrementChain;

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// A job's steps 10 (full), 20 and 30 with increments (format version 5) in a world of 3,
// and ranks 1 and 2 of each as one node's part: pieces written whole in one step and as
// extents in another, own and referenced train state, shard sizes that differ each step.
std::vector<Manifest> IncrementalParts(const std::string& root) {
  constexpr int64_t kRows = 32, kCols = 8;
  IncrementChain chain(root, "lora", 3, {{"emb", {"F32", {3 * kRows, kCols}}}, {"w", {"F32", {3, 4}}}},
                       kCols * 4 * 4);  // 4 rows a chunk: 8 chunks a piece
  std::vector<std::vector<float>> emb(3, std::vector<float>(kRows * kCols)), w(3, std::vector<float>(4));
  std::vector<Manifest> parts;
  for (uint64_t step : {10u, 20u, 30u}) {
    if (step == 20) emb[1][3] += 1;                     // one chunk of rank 1's emb: extents
    if (step == 30) emb[2].assign(kRows * kCols, 7.f);  // all of rank 2's emb: whole again
    for (auto& piece : w) piece[0] += 1;                // "w" whole every step
    IncrementChain::Step s;
    for (uint32_t r = 0; r < 3; ++r) {
      s.pieces["emb"].push_back(Floats(emb[r]));
      s.pieces["w"].push_back(Floats(w[r]));
      s.train_state.push_back({{"tok", std::string(100, 't')}, {"rng", "rng of step " + std::to_string(step)}});
    }
    Manifest part = chain.Write(step, 0x18f3a9c2d4e5b600, s);
    RemoveRanks(part, [](uint32_t r) { return r == 0; });
    REQUIRE(ParseManifest(ManifestToJson(part), "a part", ManifestScope::kPart).ok());
    parts.push_back(std::move(part));
  }
  return parts;
}

}  // namespace

TEST_CASE("a job's incremental parts keep one structure; where their bytes are travels as values") {
  ckpt::testing::TempDir dir;
  const std::vector<Manifest> parts = IncrementalParts(dir.path());
  REQUIRE(parts[1].tensors.at("emb").shards[0].extents.size() > 1);  // rank 1: own and referenced chunks
  REQUIRE(parts[1].Shard(1)->train_state.at("tok").step == 10u);
  REQUIRE(parts[1].increment->origin_steps.size() == 1);

  std::vector<SplitResult> splits;
  for (const Manifest& part : parts) splits.push_back(SplitPart(part));
  for (const SplitResult& split : splits) {
    CHECK(split.structure->digest == splits[0].structure->digest);
    CHECK(split.structure->incremental);
    CHECK(split.structure->located_pieces == 4);  // 2 tensors x 2 ranks
    CHECK(split.structure->located_blobs == 4);
    REQUIRE(split.values.increment.has_value());
  }
  CHECK(splits[2].values.increment->origin_steps == parts[2].increment->origin_steps);
  for (size_t i = 0; i < parts.size(); ++i) {
    // Each step's values on the first step's structure: that step's part exactly.
    auto joined = JoinPart(*splits[0].structure, splits[i].values);
    REQUIRE(joined.ok());
    CHECK(ManifestToJson(*joined) == ManifestToJson(parts[i]));
  }
}

TEST_CASE("incremental values that do not fit their structure are refused") {
  ckpt::testing::TempDir dir;
  const std::vector<Manifest> parts = IncrementalParts(dir.path());
  SplitResult split = SplitPart(parts[1]);
  PartValues short_places = split.values;
  short_places.places.pop_back();
  CHECK_THAT(ckpt::Message(CheckValuesFit(*split.structure, short_places)),
             Catch::Contains("do not describe 4 pieces and 4 train-state entries"));
  PartValues no_increment = split.values;
  no_increment.increment.reset();
  CHECK_THAT(ckpt::Message(CheckValuesFit(*split.structure, no_increment)), Catch::Contains("lack an increment"));
  PartValues too_many_extents = split.values;
  too_many_extents.places[0] = kMaxReadPieceChunks + 1;
  CHECK_FALSE(CheckValuesFit(*split.structure, too_many_extents).ok());
  // Withheld checksums leave the places behind too, and still fit by their count.
  PartValues counted = split.values.WithChecksumsWithheld();
  CHECK(counted.places.empty());
  REQUIRE(counted.increment.has_value());
  CHECK(counted.increment->origin_steps == split.values.increment->origin_steps);
  CHECK(CheckValuesFit(*split.structure, counted).ok());
  // A full-format structure takes no places.
  SplitResult full = SplitPart(Part(100, "xxh3:00000000000000ab"));
  CHECK_FALSE(full.structure->incremental);
  PartValues placed = full.values;
  placed.places = {0, 0, 16};
  CHECK_FALSE(CheckValuesFit(*full.structure, placed).ok());
}
