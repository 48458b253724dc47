// The read planner against a global tensor cut every way: each plan is carried out on the
// saved shards' bytes and must give exactly the wanted slice of the global tensor.
#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "format/read_plan.h"

using ckpt::format::ElementRange;
using ckpt::format::Manifest;
using ckpt::format::TensorShard;
using ckpt::format::PlanRead;
using ckpt::format::ReadPlan;
using ckpt::format::WantedTensor;

namespace {

constexpr int64_t kRows = 12, kCols = 10;

float Global(int64_t r, int64_t c) { return static_cast<float>(r * 100 + c); }

// A box (offset and shape), or flat element ranges of the flattened tensor (FSDP style).
struct Piece {
  std::vector<int64_t> offset, shape;
  std::vector<ElementRange> flat;
};

Piece Flat(std::vector<ElementRange> ranges) {
  int64_t total = 0;
  for (const ElementRange& r : ranges) total += r.end - r.begin;
  return {{}, {total}, std::move(ranges)};
}

// The bytes of a piece of the global tensor, row-major.
std::vector<char> Slice(const Piece& p) {
  std::vector<float> v;
  for (const ElementRange& r : p.flat) {
    for (int64_t i = r.begin; i < r.end; ++i) v.push_back(Global(i / kCols, i % kCols));
  }
  for (int64_t r = 0; p.flat.empty() && r < p.shape[0]; ++r) {
    for (int64_t c = 0; c < p.shape[1]; ++c) v.push_back(Global(p.offset[0] + r, p.offset[1] + c));
  }
  std::vector<char> bytes(v.size() * sizeof(float));
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

// A manifest of "w" saved in `pieces` (one per rank), and each rank's entry bytes. Each
// entry sits at a made-up offset in its file, which the plan must not confuse with 0.
struct Saved {
  Manifest manifest;
  std::map<uint32_t, std::vector<char>> entries;
};

Saved Save(const std::vector<Piece>& pieces) {
  Saved s;
  s.manifest.step = 7;
  auto& t = s.manifest.tensors["w"];
  t.dtype = "F32";
  t.global_shape = {kRows, kCols};
  for (uint32_t rank = 0; rank < pieces.size(); ++rank) {
    std::vector<char> bytes = Slice(pieces[rank]);
    TensorShard shard;
    shard.rank = rank;
    shard.file = "rank-" + std::to_string(rank);
    shard.begin = 4096 * (rank + 1);
    shard.end = shard.begin + bytes.size();
    shard.offset = pieces[rank].offset;
    shard.shape = pieces[rank].shape;
    shard.flat = pieces[rank].flat;
    t.shards.push_back(shard);
    s.entries[rank] = std::move(bytes);
  }
  return s;
}

std::vector<char> Carry(const Saved& saved, const ReadPlan& plan, size_t bytes) {
  REQUIRE(plan.tensors.size() == 1);
  std::vector<char> out(bytes, 0x7f);
  for (const auto& read : plan.tensors[0].reads) {
    const std::vector<char>& entry = saved.entries.at(read.rank);
    REQUIRE(read.entry_end - read.entry_begin == entry.size());
    for (const auto& run : read.runs) {
      REQUIRE(run.source + run.bytes <= entry.size());
      REQUIRE(run.destination + run.bytes <= out.size());
      std::memcpy(out.data() + run.destination, entry.data() + run.source, run.bytes);
    }
  }
  return out;
}

std::vector<Piece> Rows(std::vector<int64_t> heights) {
  std::vector<Piece> out;
  int64_t at = 0;
  for (int64_t h : heights) {
    out.push_back({{at, 0}, {h, kCols}});
    at += h;
  }
  return out;
}

std::vector<Piece> Columns(std::vector<int64_t> widths) {
  std::vector<Piece> out;
  int64_t at = 0;
  for (int64_t w : widths) {
    out.push_back({{0, at}, {kRows, w}});
    at += w;
  }
  return out;
}

std::vector<Piece> Blocks() {  // 2 x 2, uneven
  return {{{0, 0}, {5, 4}}, {{0, 4}, {5, 6}}, {{5, 0}, {7, 4}}, {{5, 4}, {7, 6}}};
}

// FSDP's flat shards: the flattened tensor cut in pieces that end mid-row.
std::vector<Piece> FlatCuts(std::vector<int64_t> cuts) {
  std::vector<Piece> out;
  int64_t at = 0;
  for (int64_t c : cuts) {
    out.push_back(Flat({{at, c}}));
    at = c;
  }
  return out;
}

// Several ranges per rank (a rank's flat parameter holds parts of the tensor twice).
std::vector<Piece> Interleaved() {
  return {Flat({{0, 13}, {50, 77}}), Flat({{13, 50}, {77, 120}})};
}

void CheckEveryWay(const std::vector<Piece>& saved_as) {
  Saved saved = Save(saved_as);
  const std::vector<std::vector<Piece>> layouts = {
      Rows({kRows}),              // 1 rank
      Rows({6, 6}),               // 2
      Rows({5, 4, 3}),            // 3, uneven
      Rows({2, 2, 2, 2, 1, 1, 1, 1}),  // 8
      Rows({3, 3, 3, 3}),         // the saved row layout
      Columns({5, 5}),
      Columns({1, 9}),
      Blocks(),
      FlatCuts({30, 60, 90, 120}),  // 4 even flat shards
      FlatCuts({37, 81, 120}),      // 3 uneven
      FlatCuts({120}),              // 1
      Interleaved(),
  };
  for (const auto& layout : layouts) {
    for (const Piece& p : layout) {
      WantedTensor w{"w", "F32", p.shape, {kRows, kCols}, p.offset, p.flat};
      auto plan = PlanRead(saved.manifest, {w});
      INFO("piece at [" << fmt::format("{}", fmt::join(p.offset, ",")) << "] of ["
                        << fmt::format("{}", fmt::join(p.shape, ",")) << "], flat " << p.flat.size());
      REQUIRE(plan.ok());
      std::vector<char> want = Slice(p);
      CHECK(plan->tensors[0].bytes == want.size());
      CHECK(Carry(saved, *plan, want.size()) == want);
    }
  }
}

}  // namespace

TEST_CASE("a tensor saved by 4 ranks in rows reads back in any placement, bit for bit") {
  CheckEveryWay(Rows({3, 3, 3, 3}));
}

TEST_CASE("saved in columns or blocks, it reads back as rows and the reverse") {
  CheckEveryWay(Columns({2, 3, 5}));
  CheckEveryWay(Blocks());
}

TEST_CASE("flat shards (FSDP style) read back as boxes and as other flat cuts, and the reverse") {
  CheckEveryWay(FlatCuts({30, 60, 90, 120}));
  CheckEveryWay(FlatCuts({7, 44, 45, 120}));
  CheckEveryWay(Interleaved());
}

TEST_CASE("a flat shard in its saved place reads its whole entry; rows become one run each") {
  Saved saved = Save(FlatCuts({37, 81, 120}));
  for (const Piece& p : FlatCuts({37, 81, 120})) {
    auto plan = PlanRead(saved.manifest, {{"w", "F32", p.shape, {kRows, kCols}, {}, p.flat}});
    REQUIRE(plan.ok());
    CHECK(plan->tensors[0].whole_entry());
  }
  // Rows 3..6 are elements [30, 60): from the first shard and the start of the second.
  auto rows = PlanRead(saved.manifest, {{"w", "F32", {3, kCols}, {kRows, kCols}, {3, 0}}});
  REQUIRE(rows.ok());
  REQUIRE(rows->tensors[0].reads.size() == 2);
  REQUIRE(rows->tensors[0].reads[0].runs.size() == 1);
  REQUIRE(rows->tensors[0].reads[1].runs.size() == 1);
  CHECK(rows->tensors[0].reads[0].runs[0] == ckpt::format::ByteRun{30 * 4, 0, 7 * 4});
  CHECK(rows->tensors[0].reads[1].runs[0] == ckpt::format::ByteRun{0, 7 * 4, 23 * 4});
}

TEST_CASE("flat elements no saved shard holds, and flat shards that overlap, are named") {
  Saved gap = Save({Flat({{0, 50}}), Flat({{60, 120}})});
  auto plan = PlanRead(gap.manifest, {{"w", "F32", {kRows, kCols}, {}, {}}});
  REQUIRE_FALSE(plan.ok());
  INFO(plan.status().message());
  CHECK(plan.status().message().find("w: no saved shard holds elements [50, 60) of the flattened "
                                     "tensor (10 of 120 wanted elements are missing)") != std::string::npos);
  auto flat = PlanRead(gap.manifest, {{"w", "F32", {20}, {kRows, kCols}, {}, {{40, 55}, {58, 63}}}});
  REQUIRE_FALSE(flat.ok());
  CHECK(flat.status().message().find("elements [50, 55)") != std::string::npos);
  CHECK(PlanRead(gap.manifest, {{"w", "F32", {10}, {kRows, kCols}, {}, {{40, 50}}}}).ok());

  Saved overlap = Save({Flat({{0, 70}}), Flat({{60, 120}})});
  auto twice = PlanRead(overlap.manifest, {{"w", "F32", {kRows, kCols}, {}, {}}});
  CHECK(twice.status().code() == absl::StatusCode::kDataLoss);

  // Wanted ranges out of order, empty or past the end, or a shape that is not their total.
  Saved saved = Save(FlatCuts({120}));
  for (const WantedTensor& bad : std::vector<WantedTensor>{
           {"w", "F32", {20}, {kRows, kCols}, {}, {{50, 60}, {0, 10}}},
           {"w", "F32", {0}, {kRows, kCols}, {}, {{5, 5}}},
           {"w", "F32", {10}, {kRows, kCols}, {}, {{115, 125}}},
           {"w", "F32", {2, 5}, {kRows, kCols}, {}, {{0, 10}}}}) {
    auto refused = PlanRead(saved.manifest, {bad});
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().message().find("w: the wanted piece has flat") != std::string::npos);
  }
}

TEST_CASE("the saved topology reads each rank's whole entry in one run") {
  Saved saved = Save(Rows({3, 3, 3, 3}));
  for (const Piece& p : Rows({3, 3, 3, 3})) {
    auto plan = PlanRead(saved.manifest, {{"w", "F32", p.shape, {kRows, kCols}, p.offset}});
    REQUIRE(plan.ok());
    CHECK(plan->tensors[0].whole_entry());
  }
  // Row shards read as fewer, larger rows: one run per saved shard, never one per row.
  auto half = PlanRead(saved.manifest, {{"w", "F32", {6, kCols}, {kRows, kCols}, {6, 0}}});
  REQUIRE(half.ok());
  REQUIRE(half->tensors[0].reads.size() == 2);
  for (const auto& read : half->tensors[0].reads) CHECK(read.runs.size() == 1);
  // A whole tensor wanted without a placement is the box at 0 of its shape.
  auto whole = PlanRead(saved.manifest, {{"w", "F32", {kRows, kCols}, {}, {}}});
  REQUIRE(whole.ok());
  CHECK(whole->tensors[0].reads.size() == 4);
}

TEST_CASE("a region no saved shard holds is an error naming the tensor and the range") {
  Saved saved = Save({{{0, 0}, {3, kCols}}, {{6, 0}, {6, kCols}}});  // rows 3..6 were never saved
  auto plan = PlanRead(saved.manifest, {{"w", "F32", {kRows, kCols}, {}, {}}});
  REQUIRE_FALSE(plan.ok());
  INFO(plan.status().message());
  CHECK(plan.status().message().find("w: no saved shard holds [3:6, 0:10] (30 of 120") != std::string::npos);
  // A piece inside what was saved reads fine.
  CHECK(PlanRead(saved.manifest, {{"w", "F32", {2, kCols}, {kRows, kCols}, {7, 0}}}).ok());
}

TEST_CASE("wrong names, dtypes, shapes and placements are all listed at once") {
  Saved saved = Save(Rows({6, 6}));
  saved.manifest.tensors["b"] = saved.manifest.tensors["w"];
  auto plan = PlanRead(saved.manifest, {{"gone", "F32", {1}, {}, {}},
                                        {"w", "BF16", {kRows, kCols}, {}, {}},
                                        {"b", "F32", {3, 3}, {3, 3}, {}},
                                        {"w", "F32", {6, kCols}, {kRows, kCols}, {7, 0}}});
  REQUIRE_FALSE(plan.ok());
  const std::string why(plan.status().message());
  INFO(why);
  CHECK(why.find("4 tensor(s) cannot be read from step 7") != std::string::npos);
  CHECK(why.find("gone: not in the checkpoint") != std::string::npos);
  CHECK(why.find("w: saved as F32, wanted as BF16") != std::string::npos);
  CHECK(why.find("b: global shape [12, 10] saved, [3, 3] wanted") != std::string::npos);
  CHECK(why.find("the wanted piece lies outside the global shape") != std::string::npos);
  // Non-strict: missing tensors are skipped and listed, the others still planned.
  ckpt::format::ReadPlanOptions skip_missing;
  skip_missing.allow_missing = true;
  auto lenient = PlanRead(saved.manifest,
                          {{"gone", "F32", {1}, {}, {}}, {"w", "F32", {kRows, kCols}, {}, {}}},
                          skip_missing);
  REQUIRE(lenient.ok());
  CHECK(lenient->missing == std::vector<std::string>{"gone"});
  CHECK(lenient->tensors.size() == 1);
}

TEST_CASE("a manifest whose shards overlap is damaged, not read twice") {
  Saved saved = Save({{{0, 0}, {7, kCols}}, {{5, 0}, {7, kCols}}});
  auto plan = PlanRead(saved.manifest, {{"w", "F32", {kRows, kCols}, {}, {}}});
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("scalars and one-dimensional tensors plan too, and huge run counts are refused") {
  Manifest m;
  auto& s = m.tensors["step"];
  s.dtype = "I64";
  TensorShard only;
  only.file = "f";
  only.begin = 8;
  only.end = 16;
  s.shards.push_back(only);
  auto scalar = PlanRead(m, {{"step", "I64", {}, {}, {}}});
  REQUIRE(scalar.ok());
  CHECK(scalar->tensors[0].whole_entry());
  // A 1 x N column cut of a tall tensor is a run per row: bounded.
  Saved saved = Save(Rows({kRows}));
  ckpt::format::ReadPlanOptions bounded;
  bounded.max_runs = 4;
  auto fine = PlanRead(saved.manifest, {{"w", "F32", {kRows, 1}, {kRows, kCols}, {0, 3}}}, bounded);
  CHECK(fine.status().code() == absl::StatusCode::kResourceExhausted);
}

TEST_CASE("replicated shards are read once, the preferred rank's when it holds one") {
  Saved saved = Save({{{0, 0}, {6, kCols}}, {{6, 0}, {6, kCols}}, {{0, 0}, {6, kCols}}, {{6, 0}, {6, kCols}}});
  auto plan = PlanRead(saved.manifest, {{"w", "F32", {kRows, kCols}, {}, {}}});
  REQUIRE(plan.ok());
  REQUIRE(plan->tensors[0].reads.size() == 2);
  CHECK(plan->tensors[0].reads[0].rank == 0);
  CHECK(plan->tensors[0].reads[1].rank == 1);
  auto mine = PlanRead(saved.manifest, {{"w", "F32", {6, kCols}, {kRows, kCols}, {6, 0}}}, {.prefer_rank = 3});
  REQUIRE(mine.ok());
  REQUIRE(mine->tensors[0].reads.size() == 1);
  CHECK(mine->tensors[0].reads[0].rank == 3);
  CHECK(mine->tensors[0].whole_entry());
  CHECK(Carry(saved, *mine, 6 * kCols * 4) == Slice({{6, 0}, {6, kCols}}));
}

TEST_CASE("a rank's saved pieces plan as its own whole entries (verify and same-topology restore)") {
  Saved saved = Save({Flat({{0, 13}, {50, 77}}), Piece{{0, 0}, {kRows, kCols}, {}}});
  saved.manifest.tensors["w"].shards.erase(saved.manifest.tensors["w"].shards.begin() + 1);
  Saved rows = Save(Rows({3, 3, 3, 3}));
  rows.manifest.world_size = 4;
  auto pieces = ckpt::format::SavedPieces(rows.manifest)[2];
  REQUIRE(pieces.size() == 1);
  CHECK(pieces[0].offset == std::vector<int64_t>{6, 0});
  CHECK(pieces[0].from_rank == 2u);
  auto plan = PlanRead(rows.manifest, pieces);
  REQUIRE(plan.ok());
  CHECK(plan->tensors[0].whole_entry());
  CHECK(plan->tensors[0].reads[0].rank == 2);
  saved.manifest.world_size = 1;
  auto flat = ckpt::format::SavedPieces(saved.manifest)[0];
  REQUIRE(flat.size() == 1);
  CHECK(flat[0].flat.size() == 2);
  CHECK(flat[0].shape == std::vector<int64_t>{40});
}

TEST_CASE("replicas: each wanted piece can name the rank it reads from") {
  // 3 data-parallel ranks each saved the whole tensor: every rank's piece is its own entry.
  Saved saved = Save({{{0, 0}, {kRows, kCols}}, {{0, 0}, {kRows, kCols}}, {{0, 0}, {kRows, kCols}}});
  std::vector<WantedTensor> wanted;
  for (uint32_t r : {2u, 0u, 1u}) {
    WantedTensor w{"w", "F32", {kRows, kCols}, {kRows, kCols}, {0, 0}};
    w.from_rank = r;
    wanted.push_back(w);
  }
  auto plan = PlanRead(saved.manifest, wanted);
  REQUIRE(plan.ok());
  CHECK(plan->tensors[0].reads[0].rank == 2);
  CHECK(plan->tensors[1].reads[0].rank == 0);
  CHECK(plan->tensors[2].reads[0].rank == 1);
  for (const auto& t : plan->tensors) CHECK(t.whole_entry());
}
