// A step's shards must tile each tensor exactly once before it commits.
#include <catch2/catch.hpp>

#include <string>

#include "format/part_structure.h"
#include "format/tiling.h"
#include "tests/fakes/manifest_part.h"

using ckpt::format::CheckStructuresTile;
using ckpt::format::PartStructure;
using ckpt::format::SplitPart;
using ckpt::format::CheckTiling;
using ckpt::format::MergeManifestParts;
using ckpt::format::ElementRange;
using ckpt::format::Manifest;
using ckpt::format::TensorShard;

namespace {

Manifest With(std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> pieces,
              std::vector<int64_t> global = {8, 6}) {
  Manifest m;
  auto& t = m.tensors["layer.w"];
  t.dtype = "F32";
  t.global_shape = global;
  uint32_t rank = 0;
  for (auto& [offset, shape] : pieces) {
    TensorShard s;
    s.rank = rank++;
    s.offset = offset;
    s.shape = shape;
    t.shards.push_back(s);
  }
  return m;
}

// Flat shards (FSDP style): each rank's element ranges of the flattened [8, 6] tensor.
Manifest Flat(std::vector<std::vector<ElementRange>> ranks) {
  Manifest m;
  auto& t = m.tensors["layer.w"];
  t.dtype = "F32";
  t.global_shape = {8, 6};
  uint32_t rank = 0;
  for (auto& ranges : ranks) {
    TensorShard s;
    s.rank = rank++;
    int64_t total = 0;
    for (const ElementRange& r : ranges) total += r.end - r.begin;
    s.shape = {total};
    s.flat = ranges;
    t.shards.push_back(s);
  }
  return m;
}

std::string Why(const Manifest& m) { return std::string(CheckTiling(m).message()); }

}  // namespace

TEST_CASE("rows, columns, blocks and a whole tensor tile; scalars too") {
  CHECK(CheckTiling(With({{{0, 0}, {3, 6}}, {{3, 0}, {5, 6}}})).ok());
  CHECK(CheckTiling(With({{{0, 0}, {8, 2}}, {{0, 2}, {8, 4}}})).ok());
  CHECK(CheckTiling(With({{{0, 0}, {4, 3}}, {{0, 3}, {4, 3}}, {{4, 0}, {4, 3}}, {{4, 3}, {4, 3}}})).ok());
  CHECK(CheckTiling(With({{{}, {}}})).ok());  // no placement: the whole tensor
  CHECK(CheckTiling(With({{{}, {}}}, {})).ok());  // a scalar
  // Empty shards (an FSDP rank with nothing of a small tensor) are fine.
  CHECK(CheckTiling(With({{{0, 0}, {8, 6}}, {{8, 0}, {0, 6}}})).ok());
}

TEST_CASE("overlaps, gaps and shards outside the tensor are named") {
  CHECK(Why(With({{{0, 0}, {5, 6}}, {{3, 0}, {5, 6}}})) == "tensor layer.w: ranks 0 and 1 both hold [3:5, 0:6]");
  CHECK(Why(With({{{0, 0}, {3, 6}}, {{5, 0}, {3, 6}}})) ==
        "tensor layer.w: no rank holds [3:5, 0:6] (36 of 48 elements are held)");
  // A gap and an overlap of the same size do not cancel out.
  CHECK(Why(With({{{0, 0}, {4, 6}}, {{2, 0}, {4, 6}}})) == "tensor layer.w: ranks 0 and 1 both hold [2:4, 0:6]");
  CHECK(Why(With({{{0, 0}, {8, 6}}, {{6, 0}, {4, 6}}})).find("rank 1 places its shard at [6, 0] of shape [4, 6], "
                                                               "outside the global shape [8, 6]") != std::string::npos);
  // Column shards that overlap, found by sweeping columns.
  CHECK(Why(With({{{0, 0}, {8, 4}}, {{0, 3}, {8, 3}}})) == "tensor layer.w: ranks 0 and 1 both hold [0:8, 3:4]");
}

TEST_CASE("replicas, ranks holding the very same piece, count once") {
  CHECK(CheckTiling(With({{{}, {}}, {{}, {}}, {{}, {}}})).ok());  // data parallel: all whole
  // HSDP: two replica groups of two row shards each.
  CHECK(CheckTiling(With({{{0, 0}, {4, 6}}, {{4, 0}, {4, 6}}, {{0, 0}, {4, 6}}, {{4, 0}, {4, 6}}})).ok());
  CHECK_FALSE(CheckTiling(With({{{0, 0}, {4, 6}}, {{0, 0}, {4, 6}}})).ok());  // still a gap
}

TEST_CASE("flat shards tile the flattened tensor; mixed with boxes too") {
  CHECK(CheckTiling(Flat({{{0, 13}}, {{13, 40}}, {{40, 48}}})).ok());
  CHECK(CheckTiling(Flat({{{0, 5}, {20, 48}}, {{5, 20}}})).ok());  // several ranges per rank
  CHECK(CheckTiling(Flat({{{0, 24}}, {{24, 48}}, {{0, 24}}, {{24, 48}}})).ok());  // replicas
  // Rows 0..4 as a box, the rest as a flat shard.
  Manifest mixed = Flat({{{24, 48}}});
  TensorShard rows;
  rows.rank = 1;
  rows.offset = {0, 0};
  rows.shape = {4, 6};
  mixed.tensors["layer.w"].shards.push_back(rows);
  CHECK(CheckTiling(mixed).ok());
}

TEST_CASE("flat overlaps, gaps and bad ranges are named with their elements") {
  CHECK(Why(Flat({{{0, 30}}, {{25, 48}}})) == "tensor layer.w: ranks 0 and 1 both hold elements [25, 30)");
  CHECK(Why(Flat({{{0, 20}}, {{30, 48}}})) == "tensor layer.w: no rank holds elements [20, 30) of the flattened tensor");
  CHECK(Why(Flat({{{0, 20}}, {{20, 47}}})) == "tensor layer.w: no rank holds elements [47, 48) of the flattened tensor");
  CHECK(Why(Flat({{{0, 20}}, {{20, 49}}})).find("rank 1's piece has flat element range [20, 49)") != std::string::npos);
  CHECK(Why(Flat({{{20, 48}, {0, 20}}})).find("out of order") != std::string::npos);
}

namespace {

// Checks that the parts' packed structures, as a coordinator holds them
// (CheckStructuresTile), say what merging the parts and checking the merge says; whether
// they tile.
bool SameAsMerged(const std::vector<std::pair<uint32_t, Manifest>>& parts) {
  absl::StatusOr<Manifest> merged = MergeManifestParts(parts);
  absl::Status expected = merged.ok() ? CheckTiling(*merged) : merged.status();
  INFO(expected.message());
  std::vector<std::shared_ptr<const PartStructure>> held;
  std::vector<std::pair<uint32_t, const PartStructure*>> structures;
  for (const auto& [node, part] : parts) {
    held.push_back(SplitPart(part).structure);
    structures.emplace_back(node, held.back().get());
  }
  absl::StatusOr<uint32_t> packed = CheckStructuresTile(structures);
  REQUIRE(packed.ok() == expected.ok());
  if (expected.ok()) {
    CHECK(*packed == merged->tensors.size());
  } else {
    CHECK(packed.status().code() == expected.code());
    // Structures hold no step: what names the step names step 0.
    if (expected.message().find("step ") == std::string::npos) {
      CHECK(packed.status().message() == expected.message());
    }
  }
  return expected.ok();
}

}  // namespace

TEST_CASE("tiling: parts checked in place say what their merged manifest says") {
  using ckpt::testing::ManifestPart;
  SECTION("two nodes that tile") {
    CHECK(SameAsMerged({{0, ManifestPart("job", 1, 4, {0, 1})}, {1, ManifestPart("job", 1, 4, {2, 3})}}));
  }
  SECTION("a second tensor on one node only") {
    Manifest extra = ManifestPart("job", 1, 2, {1});
    extra.tensors["b"] = {"F32", {16}, {{1, extra.shards[0].file, 64, 128, {0}, {16}, "", {}, {}}}};
    CHECK(SameAsMerged({{0, ManifestPart("job", 1, 2, {0})}, {1, extra}}));
  }
  SECTION("a piece moved over its neighbour's") {
    Manifest moved = ManifestPart("job", 1, 2, {1});
    moved.tensors["w"].shards[0].offset = {0};
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 2, {0})}, {1, moved}}));
  }
  SECTION("a rank prepared twice, or missing") {
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 3, {0, 1})}, {1, ManifestPart("job", 1, 3, {1, 2})}}));
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 3, {0})}, {1, ManifestPart("job", 1, 3, {2})}}));
  }
  SECTION("a tensor's dtype or global shape differs between nodes") {
    Manifest dtype = ManifestPart("job", 1, 2, {1});
    dtype.tensors["w"].dtype = "BF16";
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 2, {0})}, {1, dtype}}));
    Manifest shape = ManifestPart("job", 1, 2, {1});
    shape.tensors["w"].global_shape = {64};
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 2, {0})}, {1, shape}}));
  }
  SECTION("flat pieces across nodes, tiling and not") {
    auto flat = [](uint32_t rank, std::vector<ElementRange> ranges) {
      Manifest m = ckpt::testing::ManifestPart("job", 1, 2, {rank});
      int64_t n = 0;
      for (const ElementRange& r : ranges) n += r.end - r.begin;
      m.tensors["w"].shards[0].offset.clear();
      m.tensors["w"].shards[0].shape = {n};
      m.tensors["w"].shards[0].end = m.tensors["w"].shards[0].begin + 4 * static_cast<uint64_t>(n);
      m.tensors["w"].shards[0].flat = std::move(ranges);
      return m;
    };
    CHECK(SameAsMerged({{0, flat(0, {{0, 8}, {16, 24}})}, {1, flat(1, {{8, 16}, {24, 32}})}}));
    CHECK_FALSE(SameAsMerged({{0, flat(0, {{0, 9}, {16, 24}})}, {1, flat(1, {{8, 16}, {24, 32}})}}));
  }
  SECTION("a tensor with no dtype and no pieces on one node, the real one on another") {
    Manifest empty = ckpt::testing::ManifestPart("job", 1, 2, {0});
    empty.tensors["b"] = {"", {}, {}};
    Manifest real = ckpt::testing::ManifestPart("job", 1, 2, {1});
    real.tensors["b"] = {"F32", {16}, {{1, real.shards[0].file, 64, 128, {0}, {16}, "", {}, {}}}};
    CHECK_FALSE(SameAsMerged({{0, empty}, {1, real}}));
  }
  SECTION("parts of another job or world size") {
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 2, {0})}, {1, ManifestPart("other", 1, 2, {1})}}));
    CHECK_FALSE(SameAsMerged({{0, ManifestPart("job", 1, 2, {0})}, {1, ManifestPart("job", 1, 3, {1})}}));
  }
}
