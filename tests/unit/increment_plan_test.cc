// The pure planning of incremental steps (issue 48, step 3; docs/design/incremental.md,
// sections 4 and 5): the chunk policy, a rank's base from a version 5 manifest, the plan of a
// rank's write (whole pieces, __delta__ runs, references one hop, train state), rebase. Every
// plan is also applied: a tiny writer below lays each rank's file out as its plan says and
// commits the manifest from the plans' pieces, and the real readers (the planner and
// PlanReader over a CheckpointStore, and verify) read it back bit-exact.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/persist/increment_plan.h"
#include "format/checkpoint_store.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "format/safetensors.h"
#include "format/verify.h"
#include "storage/filesystem.h"
#include "tests/fakes/increment_chain.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;
using namespace ckpt::persist;
using format::Extent;
using format::Manifest;

namespace {

constexpr uint64_t kRun = 0x18f3a9c2d4e5b600;
const std::string kJob = "job";

uint64_t Xxh(const std::string& bytes, uint64_t begin = 0, uint64_t end = std::string::npos) {
  end = std::min<uint64_t>(end, bytes.size());
  return format::Checksum64(bytes.data() + begin, end - begin);
}

// Deterministic bytes that differ everywhere, so that a byte read from the wrong place shows.
std::string Bytes(uint64_t n, uint64_t seed) {
  std::string out(n, '\0');
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (char& c : out) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    c = static_cast<char>(x >> 56);
  }
  return out;
}

struct Tensor {
  std::string dtype = "F32";
  std::vector<int64_t> global_shape;  // split over the ranks by the first dimension
  bool flat = false;                  // or as flat (FSDP) ranges of the flattened tensor
  bool sparse = false;
};

// A job whose ranks' steps are planned by PlanRankWrite against the base of the step before,
// written as the plans say, committed, read back bit-exact, and made the next base.
class Job {
 public:
  Job(uint32_t world, uint64_t target, std::map<std::string, Tensor> tensors)
      : tensors(std::move(tensors)), blobs(world), world_(world), target_(target), bases_(world) {
    uint64_t seed = 1;
    for (const auto& [name, t] : this->tensors) {
      for (uint32_t r = 0; r < world_; ++r) data[name].push_back(Bytes(PieceBytes(name), seed++));
    }
  }

  // What the next save writes: per tensor, per rank; per rank, train state.
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::vector<std::string>> data;
  std::vector<std::map<std::string, std::string>> blobs;

  uint64_t PieceBytes(const std::string& name) const {
    const Tensor& t = tensors.at(name);
    uint64_t n = *DTypeSize(t.dtype);
    for (int64_t d : t.global_shape) n *= d;
    return n / world_;
  }
  std::vector<int64_t> LocalShape(const std::string& name) const {
    const Tensor& t = tensors.at(name);
    if (t.flat) return {static_cast<int64_t>(PieceBytes(name) / *DTypeSize(t.dtype))};
    std::vector<int64_t> shape = t.global_shape;
    shape[0] /= world_;
    return shape;
  }
  uint64_t ChunkBytes(const std::string& name) const {
    const Tensor& t = tensors.at(name);
    return PieceChunkBytes(LocalShape(name), *DTypeSize(t.dtype), t.flat, target_, t.sparse);
  }
  // Changes a byte of chunk `c` of rank `r`'s piece of `name`.
  void Change(const std::string& name, uint32_t r, uint64_t c) { data[name][r][c * ChunkBytes(name)] ^= 0x5a; }

  const RankBase* Base(uint32_t r) const { return bases_[r] ? &*bases_[r] : nullptr; }
  std::string StepDir(uint64_t step) const { return dir_.path() + "/" + format::CheckpointStore::StepKey(kJob, step); }

  // Plans, writes, commits and reads back `step`; each rank's plan.
  std::vector<RankWritePlan> Save(uint64_t step, PlanOptions options = {}) {
    std::filesystem::create_directories(StepDir(step));
    Manifest m;
    m.job = kJob;
    m.step = step;
    m.unix_time = 1.7e9 + static_cast<double>(step);
    m.wall_time = "2026-11-29T00:00:00Z";
    m.world_size = world_;
    m.ckptd_version = "0.1.0";
    m.run = kRun;
    m.checksum_chunk_bytes = format::kChecksumChunkBytes;
    m.increment.emplace();
    std::vector<RankWritePlan> plans;
    for (uint32_t r = 0; r < world_; ++r) {
      const RankWrite write = Write(step, r);
      absl::StatusOr<RankWritePlan> plan = PlanRankWrite(Base(r), write, options);
      INFO((plan.ok() ? "" : Message(plan.status())));
      REQUIRE(plan.ok());
      const uint64_t file_bytes = Apply(write, *plan, StepDir(step));
      for (size_t i = 0; i < write.pieces.size(); ++i) {
        format::ManifestTensor& t = m.tensors[write.pieces[i].name];
        t.dtype = tensors.at(write.pieces[i].name).dtype;
        t.global_shape = tensors.at(write.pieces[i].name).global_shape;
        t.shards.push_back(plan->pieces[i].shard);
      }
      m.shards.push_back({r, write.file, file_bytes, {}, plan->train_state});
      format::AddIncrement(*m.increment, PlanIncrement(*plan, file_bytes));
      plans.push_back(std::move(*plan));
    }
    std::ofstream(StepDir(step) + "/manifest.json", std::ios::binary) << format::ManifestToJson(m);
    Manifest loaded = Load(step);
    ReadBack(loaded);
    for (uint32_t r = 0; r < world_; ++r) {
      absl::StatusOr<RankBase> base = BaseFromManifest(loaded, r);
      REQUIRE(base.ok());
      bases_[r] = std::move(*base);
    }
    return plans;
  }

  Manifest Load(uint64_t step) {
    absl::StatusOr<Manifest> m = store_.LoadManifest(kJob, step);
    INFO((m.ok() ? "" : Message(m.status())));
    REQUIRE(m.ok());
    return *m;
  }

  // The header entries of rank r's file of `step`.
  std::vector<format::TensorEntry> Entries(uint64_t step, uint32_t r) {
    auto object = store_.objects().Open(format::CheckpointStore::StepKey(kJob, step) + "/" +
                                        format::TaggedShardFileName(r, kRun + r));
    REQUIRE(object.ok());
    absl::StatusOr<format::SafetensorsHeader> h = format::ReadHeader(**object);
    REQUIRE(h.ok());
    return h->tensors;
  }

 private:
  RankWrite Write(uint64_t step, uint32_t r) const {
    RankWrite w{step, r, format::TaggedShardFileName(r, kRun + r), {}, {}};
    for (const auto& [name, t] : tensors) {
      const std::string& bytes = data.at(name)[r];
      PieceToWrite p{name, t.dtype, LocalShape(name), {}, {}, bytes.size(), ChunkBytes(name), {},
                     format::ChecksumOf(bytes.data(), bytes.size())};
      const int64_t elements = p.shape[0];
      if (t.flat) {
        p.flat = {{elements * r, elements * (r + 1)}};
      } else {
        p.offset.assign(p.shape.size(), 0);
        p.offset[0] = p.shape[0] * r;
      }
      for (uint64_t c = 0; c < format::PieceChunks(p.bytes, p.chunk_bytes); ++c) {
        auto [lo, hi] = format::ChunkSpan(p.bytes, p.chunk_bytes, c, c + 1);
        p.chunk_checksums.push_back(Xxh(bytes, lo, hi));
      }
      w.pieces.push_back(std::move(p));
    }
    for (const auto& [name, blob] : blobs[r]) w.train_state.push_back({name, blob.size(), Xxh(blob)});
    return w;
  }

  // The writer: the file's entries as the plan lists them, each from its source's bytes.
  uint64_t Apply(const RankWrite& write, const RankWritePlan& plan, const std::string& dir) const {
    std::vector<format::TensorEntry> entries;
    std::string region;
    for (const PlannedEntry& e : plan.entries) {
      REQUIRE(e.at == region.size());
      const std::string& source = e.train_state ? blobs[write.rank].at(write.train_state[e.index].name)
                                                : data.at(write.pieces[e.index].name)[write.rank];
      region += source.substr(e.begin, e.end - e.begin);
      entries.push_back({e.name, e.dtype, e.shape, e.at, region.size()});
    }
    REQUIRE(region.size() == plan.data_bytes);
    const std::string header = format::EncodeHeader(entries, {}, 4096);
    std::ofstream(dir + "/" + write.file, std::ios::binary) << header << region;
    return header.size() + region.size();
  }

  // Every rank's pieces and train state through the real readers, and verify.
  void ReadBack(const Manifest& m) {
    const std::vector<std::vector<format::WantedTensor>> saved = format::SavedPieces(m);
    format::PlanReader reader(store_.objects(), format::CheckpointStore::StepKey(kJob, m.step), m, {});
    for (uint32_t r = 0; r < world_; ++r) {
      absl::StatusOr<format::ReadPlan> plan = format::PlanRead(m, saved[r]);
      REQUIRE(plan.ok());
      REQUIRE(reader.Open(plan->tensors).ok());
      for (const format::TensorReadPlan& t : plan->tensors) {
        std::string bytes(t.bytes, '\0');
        absl::Status read = reader.Read(t, bytes.data());
        INFO("step " << m.step << ", rank " << r << ", " << t.name << ": " << Message(read));
        REQUIRE(read.ok());
        CHECK(bytes == data.at(t.name)[r]);
      }
      absl::StatusOr<std::vector<format::NamedBytes>> state = reader.TrainState(r);
      REQUIRE(state.ok());
      std::map<std::string, std::string> got;
      for (format::NamedBytes& b : *state) got[b.name] = b.data;
      CHECK(got == blobs[r]);
    }
    absl::StatusOr<format::VerifyReport> report = format::VerifyCheckpoint(store_, kJob, m.step);
    REQUIRE(report.ok());
    INFO(fmt::format("{}", fmt::join(report->problems, "\n")));
    CHECK(report->ok());
    CHECK(report->bytes_referenced == m.increment->referenced_bytes);
  }

  const uint32_t world_;
  const uint64_t target_;
  testing::TempDir dir_;
  format::CheckpointStore store_{MakePosixFilesystem(), dir_.path()};
  std::vector<std::optional<RankBase>> bases_;
};

// "emb": [64, 16] F32 on each rank, 4 rows (256 bytes) a chunk: 16 chunks a piece.
constexpr uint64_t kChunk = 256;
std::map<std::string, Tensor> Emb(uint32_t world = 1) { return {{"emb", {"F32", {64 * world, 16}}}}; }

std::vector<std::string> Whys(const RankWritePlan& plan) {
  std::vector<std::string> out;
  for (const PlannedPiece& p : plan.pieces) out.push_back(p.why);
  return out;
}

}  // namespace

TEST_CASE("chunks: row blocks of 2-D pieces, windows of wide rows, 1-D and flat pieces") {
  constexpr uint64_t kMiB = 1 << 20;
  // Rows of 4000 bytes: 1048 of them in 4 MiB.
  CHECK(PieceChunkBytes({5000, 1000}, 4, false, 4 * kMiB, false) == 1048 * 4000);
  CHECK(PieceChunkBytes({5000, 1024}, 4, false, 4 * kMiB, false) == 4 * kMiB);
  CHECK(PieceChunkBytes({100, 10, 100}, 2, false, 64 << 10, false) == 32 * 2000);  // rows of [10, 100] BF16
  // A row of 8 MB: windows of the target.
  CHECK(PieceChunkBytes({4, 2'000'000}, 4, false, 4 * kMiB, false) == 4 * kMiB);
  CHECK(PieceChunkBytes({4, 2'000'000}, 8, false, 65539, false) == 65536);  // whole elements
  // 1-D, and flat whatever the shape says.
  CHECK(PieceChunkBytes({3'000'000}, 4, false, 4 * kMiB, false) == 4 * kMiB);
  CHECK(PieceChunkBytes({3'000'000}, 8, true, 100'003, false) == 100'000);
  CHECK(PieceChunkBytes({3000, 1000}, 4, true, 4 * kMiB, false) == 4 * kMiB);
}

TEST_CASE("chunks: a piece up to the target is one chunk of its own size, one element at least") {
  CHECK(PieceChunkBytes({3, 5}, 4, false, 4 << 20, false) == 60);
  CHECK(PieceChunkBytes({1024, 1024}, 4, false, 4 << 20, false) == 4 << 20);
  CHECK(PieceChunkBytes({0, 5}, 4, false, 4 << 20, false) == 4);
  CHECK(PieceChunkBytes({}, 8, false, 4 << 20, false) == 8);
  CHECK(PieceChunkBytes({7}, 2, true, 4 << 20, false) == 14);
}

TEST_CASE("chunks: sparse tables get 1 KiB, at least one row") {
  // GPT-2's embedding: rows of 4 KiB, one a chunk, 50,257 chunks (the design's figure).
  const uint64_t wte = PieceChunkBytes({50257, 1024}, 4, false, 4 << 20, true);
  CHECK(wte == 4096);
  CHECK(format::PieceChunks(uint64_t{50257} * 4096, wte) == 50257);
  // A recommender's table: rows of 256 bytes, 4 a chunk.
  CHECK(PieceChunkBytes({100'000, 64}, 4, false, 4 << 20, true) == 1024);
  // Past 64 MiB the chunk count binds: 1M such rows, 16 a chunk.
  CHECK(PieceChunkBytes({1'000'000, 64}, 4, false, 4 << 20, true) == 16 * 256);
  CHECK(PieceChunkBytes({100, 5000}, 4, false, 4 << 20, true) == 20000);  // one row, not cut
  CHECK(PieceChunkBytes({1'000'000}, 4, false, 4 << 20, true) == 1024);
  CHECK(PieceChunkBytes({200}, 4, false, 4 << 20, true) == 800);  // small: one chunk
}

TEST_CASE("chunks: a sparse piece's limit is its share of the node's budget, by size and by ranks") {
  constexpr uint64_t kTable = uint64_t{1'000'000} * 256;  // 1M rows of 64 F32
  // Alone on its node: the whole budget (a million chunks), so rows of 256 bytes get 1 KiB.
  const uint64_t alone = SparsePieceMaxChunks(kTable, kTable, 1);
  CHECK(alone == kSparseChunksPerNode);
  CHECK(PieceChunkBytes({1'000'000, 64}, 4, false, 4 << 20, true, alone) == 1024);
  // Eight ranks of the job on the node: an eighth each, 2 KiB.
  const uint64_t eighth = SparsePieceMaxChunks(kTable, kTable, 8);
  CHECK(eighth == kSparseChunksPerNode / 8);
  CHECK(PieceChunkBytes({1'000'000, 64}, 4, false, 4 << 20, true, eighth) == 2048);
  // Two tables on the rank share its part by size.
  CHECK(SparsePieceMaxChunks(kTable, 4 * kTable, 1) == kSparseChunksPerNode / 4);
  // Never fewer than a dense piece may have, never more than a reader takes; no overflow.
  CHECK(SparsePieceMaxChunks(1024, uint64_t{1} << 40, 64) == format::kMaxPieceChunks);
  CHECK(SparsePieceMaxChunks(uint64_t{1} << 44, uint64_t{1} << 44, 0) == format::kMaxReadPieceChunks);
  CHECK(SparsePieceMaxChunks(uint64_t{1} << 44, 0, 1) == format::kMaxReadPieceChunks);
  // A limit above what readers take is held to it.
  CHECK(format::PieceChunks(uint64_t{1} << 34, PieceChunkBytes({int64_t{1} << 34}, 1, false, 1, true, uint64_t{1} << 40)) <=
        format::kMaxReadPieceChunks);
}

TEST_CASE("chunks: at most 65,536 a piece; the chunk grows to fit, in whole rows for row blocks") {
  // 8 GiB 1-D in 64 KiB windows would be 131,072 chunks.
  CHECK(PieceChunkBytes({int64_t{1} << 33}, 1, false, 64 << 10, false) == 128 << 10);
  // Rows of 1 KiB, one a sparse chunk, 2^24 rows: 256 rows a chunk instead.
  CHECK(PieceChunkBytes({int64_t{1} << 24, 256}, 4, false, 4 << 20, true) == 256 * 1024);
  // Rows of 7 * 3 elements; the grown block is whole rows.
  const uint64_t odd = PieceChunkBytes({100'000'000, 7, 3}, 2, false, 64 << 10, false);
  CHECK(odd % 42 == 0);
  CHECK(format::PieceChunks(uint64_t{100'000'000} * 42, odd) <= format::kMaxPieceChunks);
  // Every chunk a positive multiple of the element, within the limit, rows whole when a row
  // fits the target, over shapes, element sizes, targets and hints.
  for (size_t itemsize : {1, 2, 4, 8}) {
    for (uint64_t target : {uint64_t{1}, uint64_t{1000}, uint64_t{65537}, uint64_t{4} << 20, uint64_t{64} << 20}) {
      for (bool sparse : {false, true}) {
        for (bool flat : {false, true}) {
          for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
                   {}, {1}, {3}, {0, 9}, {13, 17}, {1000, 333}, {int64_t{1} << 31}, {5, int64_t{1} << 30},
                   {int64_t{1} << 28, 3}, {123457, 11, 13}}) {
            const uint64_t chunk = PieceChunkBytes(shape, itemsize, flat, target, sparse);
            uint64_t bytes = itemsize;
            for (int64_t d : shape) bytes *= d;
            INFO(fmt::format("shape [{}], itemsize {}, target {}, sparse {}, flat {}: chunk {}", fmt::join(shape, ", "),
                             itemsize, target, sparse, flat, chunk));
            CHECK(chunk > 0);
            CHECK(chunk % itemsize == 0);
            CHECK(format::PieceChunks(bytes, chunk) <= format::kMaxPieceChunks);
            if (!flat && shape.size() >= 2 && shape[0] > 0 && bytes > 0) {
              const uint64_t row = bytes / shape[0];
              if (row <= std::max<uint64_t>(sparse ? kSparseChunkBytes : target, itemsize) || sparse) {
                CHECK(chunk % row == 0);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("--increment-chunk-bytes: 64 KiB to 64 MiB, a clear message outside") {
  CHECK(CheckIncrementChunkBytes(kDefaultIncrementChunkBytes).ok());
  CHECK(CheckIncrementChunkBytes(64 << 10).ok());
  CHECK(CheckIncrementChunkBytes(64 << 20).ok());
  for (uint64_t bad : {uint64_t{0}, uint64_t{65535}, (uint64_t{64} << 20) + 1}) {
    absl::Status s = CheckIncrementChunkBytes(bad);
    CHECK(absl::IsInvalidArgument(s));
    CHECK_THAT(Message(s), Catch::Contains("--increment-chunk-bytes " + std::to_string(bad) +
                                           " is outside the allowed range, 65536 (64 KiB) to 67108864 (64 MiB)"));
  }
}

TEST_CASE("a base from a hand-written chain: each chunk where the step that wrote it put it") {
  testing::TempDir dir;
  testing::IncrementChain chain(dir.path(), kJob, 2, {{"emb", {"F32", {128, 16}}}, {"w", {"F32", {4, 4}}}}, kChunk);
  std::vector<std::string> emb = {Bytes(4096, 1), Bytes(4096, 2)}, w = {Bytes(32, 3), Bytes(32, 4)};
  auto save = [&](uint64_t step) {
    testing::IncrementChain::Step s;
    s.pieces = {{"emb", emb}, {"w", w}};
    s.train_state = {{{"tok", std::string(300, 'a')}}, {{"tok", std::string(300, 'b')}}};
    return chain.Write(step, kRun, s);
  };
  save(10);
  emb[0][5 * kChunk / 4] ^= 1;  // chunk 1
  emb[0][40 * 64] ^= 1;         // chunk 10
  w[1][8] ^= 1;
  save(20);
  emb[0][6 * 64 + 4] ^= 1;  // chunk 1 again
  const Manifest m30 = save(30);

  absl::StatusOr<RankBase> base = BaseFromManifest(m30, 0);
  REQUIRE(base.ok());
  CHECK(base->step == 30);
  CHECK(base->run == kRun);
  // Files: step 30's own first, then the origins as the chunks name them.
  REQUIRE(base->files.size() == 3);
  CHECK(base->files[0] == format::Origin{30, kRun, 0, m30.shards[0].file, m30.shards[0].bytes});
  CHECK(*m30.increment->Find(base->files[1].step, 0) == base->files[1]);
  CHECK(*m30.increment->Find(base->files[2].step, 0) == base->files[2]);
  const PieceBase& p = base->pieces.at("emb");
  CHECK(p.shape == std::vector<int64_t>{64, 16});
  CHECK(p.chunk_bytes == kChunk);
  REQUIRE(p.chunks.size() == 16);
  auto step_of = [&](uint64_t c) { return base->files[p.chunks[c].file].step; };
  CHECK(step_of(0) == 10);
  CHECK(step_of(1) == 30);
  CHECK(step_of(10) == 20);
  CHECK(step_of(15) == 10);
  const std::vector<Extent>& extents = m30.tensors.at("emb").shards[0].extents;
  CHECK(p.chunks[3].at == extents[2].at + kChunk);  // [2, 10) in step 10
  CHECK(p.chunks[3].continues);
  CHECK_FALSE(p.chunks[2].continues);
  for (uint64_t c = 0; c < 16; ++c) CHECK(p.chunks[c].checksum == Xxh(emb[0], c * kChunk, (c + 1) * kChunk));
  CHECK(base->train_state.at("tok").bytes == 300);
  CHECK(base->files[base->train_state.at("tok").file].step == 10);

  // Rank 1: w (one chunk) unchanged since 20; its whole checksum is the chunk's.
  absl::StatusOr<RankBase> base1 = BaseFromManifest(m30, 1);
  REQUIRE(base1.ok());
  const PieceBase& w1 = base1->pieces.at("w");
  REQUIRE(w1.chunks.size() == 1);
  CHECK(base1->files[w1.chunks[0].file].step == 20);
  CHECK(w1.chunks[0].checksum == Xxh(w[1]));

  // Planned again unchanged, rank 0's emb references what step 30 lists, its own chunk in 30.
  RankWrite write{40, 0, m30.shards[0].file, {}, {}};
  PieceToWrite piece{"emb", "F32", {64, 16}, {0, 0}, {}, 4096, kChunk, {}, format::ChecksumOf(emb[0].data(), 4096)};
  for (uint64_t c = 0; c < 16; ++c) piece.chunk_checksums.push_back(Xxh(emb[0], c * kChunk, (c + 1) * kChunk));
  write.pieces.push_back(piece);
  absl::StatusOr<RankWritePlan> plan = PlanRankWrite(&*base, write, {});
  REQUIRE(plan.ok());
  std::vector<Extent> expected = extents;
  expected[1].step = 30;
  CHECK(plan->pieces[0].shard.extents == expected);
  CHECK(plan->mode == WriteMode::kIncrement);
  CHECK(plan->entries.empty());

  SECTION("not from versions 1 to 4, an index, or a rank it does not list") {
    Manifest old = m30;
    old.increment.reset();
    old.format_version = format::kManifestIndexFormatVersion;
    absl::StatusOr<RankBase> none = BaseFromManifest(old, 0);
    CHECK(absl::IsFailedPrecondition(none.status()));
    CHECK_THAT(Message(none.status()), Catch::Contains("step 30 is format version 4: only version 5 files are referenced"));
    CHECK(absl::IsNotFound(BaseFromManifest(m30, 2).status()));
  }
}

TEST_CASE("no base: every piece whole, the train state written, mode full") {
  Job job(2, kChunk, Emb(2));
  job.blobs = {{{"rng", "r0"}, {"tok", std::string(70000, 't')}}, {{"rng", "r1"}}};
  std::vector<RankWritePlan> plans = job.Save(10);
  for (const RankWritePlan& plan : plans) {
    CHECK(plan.mode == WriteMode::kFull);
    CHECK(plan.reason == "full: no base");
    CHECK(plan.origins.empty());
    CHECK(plan.referenced_bytes == 0);
    REQUIRE(plan.pieces.size() == 1);
    CHECK(plan.pieces[0].whole);
    CHECK(plan.pieces[0].shard.chunk_checksums.size() == 16);
    CHECK(plan.pieces[0].shard.chunk_bytes == kChunk);
  }
  CHECK(plans[0].data_bytes == 4096 + 2 + 70000);
  CHECK(plans[0].entries[0].name == "emb");
  CHECK(job.Load(10).format_version == format::kManifestIncrementFormatVersion);
}

TEST_CASE("an unchanged piece is one reference extent; big unchanged train state is referenced, small written") {
  Job job(1, kChunk, Emb());
  job.blobs[0] = {{"rng", "r"}, {"tok", std::string(64 << 10, 't')}, {"big", std::string(100000, 'b')},
                  {"almost", std::string((64 << 10) - 1, 'a')}};
  std::vector<RankWritePlan> first = job.Save(10);
  job.blobs[0]["big"][7] = 'x';
  const RankWritePlan plan = job.Save(20)[0];
  REQUIRE(plan.pieces[0].shard.extents == std::vector<Extent>{{0, 16, 10, first[0].pieces[0].shard.begin}});
  CHECK(plan.pieces[0].shard.file.empty());
  CHECK(plan.pieces[0].why == "1 extent");
  CHECK(plan.train_state.at("tok").step == 10);
  CHECK(plan.train_state.at("tok").begin == first[0].train_state.at("tok").begin);
  CHECK_FALSE(plan.train_state.at("rng").step);
  CHECK_FALSE(plan.train_state.at("almost").step);  // one byte under 64 KiB
  CHECK_FALSE(plan.train_state.at("big").step);     // changed
  CHECK(plan.referenced_bytes == 4096 + (64 << 10));
  CHECK(plan.data_bytes == 1 + 100000 + (64 << 10) - 1);
  CHECK(plan.mode == WriteMode::kIncrement);
  CHECK_THAT(plan.reason, Catch::StartsWith("increment: ") && Catch::Contains("referenced in 1 file"));
  REQUIRE(plan.origins.size() == 1);
  CHECK(plan.origins[0].step == 10);
  const Manifest m = job.Load(20);
  CHECK(m.increment->origin_steps == std::vector<format::StepRun>{{10, kRun}});
  CHECK(m.increment->referenced_bytes == plan.referenced_bytes);
}

TEST_CASE("one chunk of 16 changed: three extents, the changed one a __delta__ entry of whole rows") {
  Job job(2, kChunk, Emb(2));
  const RankWritePlan base = job.Save(10)[1];
  job.Change("emb", 1, 6);
  const RankWritePlan plan = job.Save(20)[1];
  const uint64_t at = base.pieces[0].shard.begin;
  CHECK(plan.pieces[0].shard.extents ==
        std::vector<Extent>{{0, 6, 10, at}, {6, 7, std::nullopt, 0}, {7, 16, 10, at + 7 * kChunk}});
  REQUIRE(plan.entries.size() == 1);
  CHECK(plan.entries[0].name == "__delta__.6-7.emb");
  CHECK(plan.entries[0].shape == std::vector<int64_t>{4, 16});
  CHECK(plan.entries[0].begin == 6 * kChunk);
  CHECK(plan.entries[0].end == 7 * kChunk);
  CHECK(plan.data_bytes == kChunk);
  CHECK(plan.referenced_bytes == 15 * kChunk);
  CHECK(job.Entries(20, 1)[0].name == "__delta__.6-7.emb");
  // Rank 0 changed nothing: one reference.
  CHECK(job.Load(20).tensors.at("emb").shards[0].extents.size() == 1);
}

TEST_CASE("chunks unchanged since different steps point at the step that wrote them (one hop)") {
  Job job(1, kChunk, Emb());
  const uint64_t at10 = job.Save(10)[0].pieces[0].shard.begin;
  job.Change("emb", 0, 3);
  job.Save(20);
  job.Change("emb", 0, 9);
  RankWritePlan plan = job.Save(30)[0];
  CHECK(plan.pieces[0].shard.extents == std::vector<Extent>{{0, 3, 10, at10},
                                                            {3, 4, 20, 0},
                                                            {4, 9, 10, at10 + 4 * kChunk},
                                                            {9, 10, std::nullopt, 0},
                                                            {10, 16, 10, at10 + 10 * kChunk}});
  REQUIRE(plan.origins.size() == 2);
  CHECK(plan.origins[0].step == 10);
  CHECK(plan.origins[1].step == 20);
  // Nothing changes in 40: chunk 9 is in 30's file, chunk 3 still in 20's, never "in 30".
  plan = job.Save(40)[0];
  CHECK(plan.pieces[0].shard.extents == std::vector<Extent>{{0, 3, 10, at10},
                                                            {3, 4, 20, 0},
                                                            {4, 9, 10, at10 + 4 * kChunk},
                                                            {9, 10, 30, 0},
                                                            {10, 16, 10, at10 + 10 * kChunk}});
  CHECK(job.Load(40).increment->origin_steps == std::vector<format::StepRun>{{10, kRun}, {20, kRun}, {30, kRun}});
  CHECK(plan.entries.empty());
}

TEST_CASE("a piece written whole: more than half changed, too many extents, another shape; full asked for") {
  SECTION("more than half its bytes changed") {
    Job job(1, kChunk, Emb());
    job.Save(10);
    for (uint64_t c = 0; c < 9; ++c) job.Change("emb", 0, c * 16 / 9);
    const RankWritePlan plan = job.Save(20)[0];
    CHECK(plan.pieces[0].whole);
    CHECK(plan.pieces[0].why == "56% changed");
    CHECK(plan.mode == WriteMode::kFull);
    CHECK(plan.reason == "full: 56% changed");
    CHECK(plan.changed_bytes == 9 * kChunk);
  }
  SECTION("exactly half changed: extents still") {
    Job job(1, kChunk, Emb());
    job.Save(10);
    for (uint64_t c = 0; c < 8; ++c) job.Change("emb", 0, 2 * c);
    const RankWritePlan plan = job.Save(20)[0];
    CHECK_FALSE(plan.pieces[0].whole);
    CHECK(plan.pieces[0].shard.extents.size() == 16);
  }
  SECTION("more than max(64, chunks / 2) extents") {
    // [800, 16] F32: 200 chunks; every 2nd changed is 50% and 200 extents, and writing the
    // references between them again to fit in 100 would write them all: whole.
    Job job(1, kChunk, {{"emb", {"F32", {800, 16}}}, {"w", {"F32", {4, 4}}}});
    job.Save(10);
    for (uint64_t c = 0; c < 200; c += 2) job.Change("emb", 0, c);
    RankWritePlan plan = job.Save(20)[0];
    CHECK(plan.pieces[0].whole);
    CHECK(plan.pieces[0].why == "200 extents, more than 100");
    CHECK_FALSE(plan.pieces[1].whole);  // w, unchanged, referenced
    CHECK(plan.mode == WriteMode::kIncrement);
    // 100 extents are allowed: 50 changed chunks, 2 extents each.
    for (uint64_t c = 0; c < 100; c += 2) job.Change("emb", 0, c);
    plan = job.Save(30)[0];
    CHECK_FALSE(plan.pieces[0].whole);
    CHECK(plan.pieces[0].shard.extents.size() == 100);
  }
  SECTION("more extents than allowed, fewer with the shortest references written again") {
    // 200 chunks: 0, 2, ..., 40 changed (20 references of one chunk between them), then 44,
    // 48, ..., 196 (references of three): 120 extents. Writing the one-chunk references
    // again leaves 80.
    Job job(1, kChunk, {{"emb", {"F32", {800, 16}}}});
    job.Save(10);
    for (uint64_t c = 0; c <= 40; c += 2) job.Change("emb", 0, c);
    for (uint64_t c = 44; c < 200; c += 4) job.Change("emb", 0, c);
    const RankWritePlan plan = job.Save(20)[0];
    CHECK_FALSE(plan.pieces[0].whole);
    CHECK(plan.pieces[0].why == "80 extents (120 needed, more than 100: the shortest references written again)");
    const std::vector<format::Extent>& extents = plan.pieces[0].shard.extents;
    REQUIRE(extents.size() == 80);
    CHECK(extents[0].chunk_begin == 0);
    CHECK(extents[0].chunk_end == 41);  // chunks 0 to 40 in this step's file, as one run
    CHECK_FALSE(extents[0].step.has_value());
    CHECK(extents[1].step == 10);
    CHECK(plan.changed_bytes == 60 * kChunk);  // what changed; 80 chunks written (Save reads it back)
    uint64_t own = 0;
    for (const format::Extent& e : extents) own += e.step ? 0 : e.chunk_end - e.chunk_begin;
    CHECK(own == 80);
  }
  SECTION("another shape, a new tensor") {
    Job job(1, kChunk, {{"emb", {"F32", {64, 16}}}, {"w", {"F32", {4, 4}}}});
    job.Save(10);
    job.tensors["emb"].global_shape = {60, 16};
    job.data["emb"][0].resize(60 * 64);
    job.tensors["new"] = {"F32", {2, 2}};
    job.data["new"] = {Bytes(16, 99)};
    const RankWritePlan plan = job.Save(20)[0];
    CHECK(Whys(plan) == std::vector<std::string>{"shape [60, 16], its base's [64, 16]", "new", "1 extent"});
    CHECK(plan.changed_bytes == 60 * 64 + 16);  // the pieces not compared count whole
    CHECK(plan.mode == WriteMode::kIncrement);
    for (const char* gone : {"w", "new"}) job.tensors.erase(gone), job.data.erase(gone);
    job.tensors["emb"].dtype = "I32";
    const RankWritePlan full = job.Save(30)[0];
    CHECK(full.mode == WriteMode::kFull);
    CHECK(full.reason == "full: tensor emb: dtype I32, its base's F32");
  }
  SECTION("full=true references nothing") {
    Job job(1, kChunk, Emb());
    job.blobs[0] = {{"tok", std::string(100000, 't')}};
    job.Save(10);
    const RankWritePlan plan = job.Save(20, {.full = true})[0];
    CHECK(plan.mode == WriteMode::kFull);
    CHECK(plan.reason == "full: asked for");
    CHECK(plan.changed_bytes == 0);  // compared all the same
    CHECK(plan.origins.empty());
    CHECK(plan.pieces[0].whole);
    CHECK_FALSE(plan.train_state.at("tok").step);
    CHECK(job.Load(20).increment->origin_steps.empty());
  }
}

TEST_CASE("flat pieces are planned by element windows and read back") {
  Job job(2, 1000, {{"flat", {"BF16", {100, 30}, /*flat=*/true}}});
  CHECK(job.ChunkBytes("flat") == 1000);
  job.Save(10);
  job.Change("flat", 1, 1);
  const RankWritePlan plan = job.Save(20)[1];
  CHECK(plan.pieces[0].shard.extents.size() == 3);
  CHECK(plan.entries[0].shape == std::vector<int64_t>{500});
  CHECK(plan.pieces[0].shard.flat == std::vector<format::ElementRange>{{1500, 3000}});
}

TEST_CASE("a rebase writes again what sits in a mostly dead file and keeps the live one") {
  // Chunks of 4 KiB: "a", "b" and "c" are 64 KiB each, 16 chunks.
  Job job(1, 4096, {{"a", {"F32", {256, 64}}}, {"b", {"F32", {256, 64}}}, {"c", {"F32", {256, 64}}}});
  job.Save(10);
  for (uint64_t c = 0; c < 8; ++c) job.Change("a", 0, c);
  for (uint64_t c = 0; c < 16; ++c) job.Change("c", 0, c);
  job.Save(20);  // a: half in 20, half in 10; b: all in 10; c: whole in 20
  // Step 10's file: 192 KiB of data, 96 KiB still used: under half with its header.
  RankWritePlan plan = job.Save(30)[0];
  CHECK(plan.mode == WriteMode::kIncrement);
  CHECK(plan.origins.size() == 2);
  plan = job.Save(40, {.rebase = true})[0];
  CHECK(plan.mode == WriteMode::kRebase);
  CHECK_THAT(plan.reason, Catch::StartsWith("rebase: ") && Catch::EndsWith(", 1 file dropped"));
  REQUIRE(plan.origins.size() == 1);
  CHECK(plan.origins[0].step == 20);
  CHECK(plan.pieces[0].shard.extents == std::vector<Extent>{{0, 8, 20, 0}, {8, 16, std::nullopt, 0}});
  CHECK(plan.pieces[1].whole);
  CHECK(plan.pieces[1].why == "100% changed or in files the rebase drops");
  CHECK(plan.pieces[2].shard.extents.size() == 1);
  CHECK(plan.pieces[2].shard.extents[0].step == 20);
  CHECK(plan.data_bytes == 32768 + 65536);
  // The next increment references 20 and 40 only: step 10 is no longer held by the chain.
  plan = job.Save(50)[0];
  CHECK(job.Load(50).increment->origin_steps == std::vector<format::StepRun>{{20, kRun}, {40, kRun}});
}

TEST_CASE("a rebase keeps the 16 liveliest files, the newest among equals") {
  // 24 chunks of 16 KiB; steps 11 to 30 each change one chunk, so step 31 references 21 files.
  Job job(1, 16384, {{"a", {"F32", {24 * 64, 64}}}});
  job.Save(10);
  for (uint64_t step = 11; step <= 30; ++step) {
    job.Change("a", 0, step - 10);
    job.Save(step);
  }
  RankWritePlan plan = job.Save(31, {.rebase = true})[0];
  std::vector<uint64_t> steps;
  for (const format::Origin& o : plan.origins) steps.push_back(o.step);
  std::vector<uint64_t> newest16;
  for (uint64_t s = 15; s <= 30; ++s) newest16.push_back(s);
  CHECK(steps == newest16);
  // Chunks 0 and 21-23 (in step 10's mostly dead file) and 1-4 (in 11-14's) written again.
  const std::vector<Extent>& extents = plan.pieces[0].shard.extents;
  REQUIRE(extents.size() == 18);
  CHECK(extents.front() == Extent{0, 5, std::nullopt, 0});
  CHECK(extents[1] == Extent{5, 6, 15, 0});
  CHECK(extents.back() == Extent{21, 24, std::nullopt, 5 * 16384});
  CHECK(plan.data_bytes == 8 * 16384);
  CHECK(RebaseDue(19, 20));
  CHECK_FALSE(RebaseDue(18, 20));
  CHECK(RebaseDue(0, 1));
  CHECK_FALSE(RebaseDue(1000, 0));
}

TEST_CASE("a write that does not hold together is refused, naming the tensor") {
  Job job(2, kChunk, Emb(2));
  job.Save(10);
  RankWrite write{20, 0, format::TaggedShardFileName(0, kRun), {}, {}};
  write.pieces.push_back({"emb", "F32", {64, 16}, {0, 0}, {}, 4096, kChunk, {1, 2, 3}, "xxh3:0000000000000000"});
  absl::StatusOr<RankWritePlan> plan = PlanRankWrite(job.Base(0), write, {});
  CHECK(absl::IsInvalidArgument(plan.status()));
  CHECK_THAT(Message(plan.status()), Catch::Contains("tensor emb: 3 chunk checksums for 16 chunks of 256 bytes"));
  write.pieces[0].chunk_bytes = 255;
  CHECK_THAT(Message(PlanRankWrite(nullptr, write, {}).status()),
             Catch::Contains("chunk_bytes 255 is not a positive multiple of F32's 4 bytes"));
  write.pieces[0].chunk_bytes = kChunk;
  write.pieces[0].chunk_checksums.resize(16);
  write.rank = 1;
  CHECK_THAT(Message(PlanRankWrite(job.Base(0), write, {}).status()),
             Catch::Contains("rank 1's write planned against rank 0's base"));
}

TEST_CASE("a step saved again on top of its own base references none of its own files") {
  Job job(1, kChunk, Emb());
  job.Save(10);
  job.Change("emb", 0, 0);
  job.Save(20);
  // Step 20 again (a new save of the same number): chunk 0 is in 20's file, the rest in 10's.
  const RankWritePlan plan = job.Save(20)[0];
  CHECK(plan.pieces[0].shard.extents == std::vector<Extent>{{0, 1, std::nullopt, 0}, {1, 16, 10, kChunk}});
}

TEST_CASE("references merge only within one entry of the base's file, however the bytes lie") {
  // A base (from another writer) whose file holds chunks 0 and 1 as two entries, back to
  // back: one extent over both would cross entries, which readers refuse.
  RankBase base;
  base.step = 10;
  base.files.push_back({10, kRun, 0, format::TaggedShardFileName(0, kRun), 4096 + 3 * kChunk});
  PieceBase& p = base.pieces["emb"];
  p = {"F32", {12, 16}, {0, 0}, {}, 3 * kChunk, kChunk, {}};
  const std::string bytes = Bytes(3 * kChunk, 7);
  for (uint64_t c = 0; c < 3; ++c) p.chunks.push_back({Xxh(bytes, c * kChunk, (c + 1) * kChunk), c * kChunk, 0, c == 2});
  RankWrite write{20, 0, format::TaggedShardFileName(0, kRun + 1), {}, {}};
  write.pieces.push_back({"emb", "F32", {12, 16}, {0, 0}, {}, 3 * kChunk, kChunk, {}, ""});
  for (const ChunkWhere& w : p.chunks) write.pieces[0].chunk_checksums.push_back(w.checksum);
  absl::StatusOr<RankWritePlan> plan = PlanRankWrite(&base, write, {});
  REQUIRE(plan.ok());
  CHECK(plan->pieces[0].shard.extents == std::vector<Extent>{{0, 1, 10, 0}, {1, 3, 10, kChunk}});
}
