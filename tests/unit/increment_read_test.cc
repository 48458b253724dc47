// Format version 5 read back (issue 48, step 1): a chain of incremental steps written by hand
// (tests/fakes/increment_chain.h) read through the planner in the saved placement and in
// others, from memory and from disk, verified, with its origin retired to a held directory,
// damaged, missing or replaced.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "client/export/exporter.h"
#include "common/status.h"
#include "format/checkpoint_store.h"
#include "format/manifest.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "format/verify.h"
#include "storage/filesystem.h"
#include "tests/fakes/flip_bit.h"
#include "tests/fakes/increment_chain.h"
#include "tests/fakes/read_saved.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;
using namespace ckpt::format;
using ckpt::testing::IncrementChain;
namespace fs = std::filesystem;

namespace {

constexpr uint32_t kWorld = 2;
constexpr int64_t kRows = 64;  // "emb" is [kWorld * kRows, kCols] F32; each rank holds kRows rows
constexpr int64_t kCols = 16;
constexpr uint64_t kChunk = kCols * 4 * 4;  // 4 rows a chunk: 16 chunks a piece
constexpr uint64_t kRun = 0x18f3a9c2d4e5b600;
const std::string kJob = "lora";

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// The chain's data: "emb" rows that change where a step says, "w" (one chunk) that changes
// on rank 1 at step 20, and train state ("tok" never changes, "rng" every step).
struct Chain {
  testing::TempDir dir;
  IncrementChain writer{dir.path(), kJob, kWorld,
                        {{"emb", {"F32", {kWorld * kRows, kCols}}}, {"w", {"F32", {kWorld * 2, 4}}}}, kChunk};
  CheckpointStore store{MakePosixFilesystem(), dir.path()};
  std::vector<float> emb[kWorld], w[kWorld];
  std::map<uint64_t, IncrementChain::Step> saved;  // by step: what each step holds

  Chain() {
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kRows * kCols; ++i) emb[r].push_back(static_cast<float>(r * 100000 + i));
      for (int i = 0; i < 8; ++i) w[r].push_back(static_cast<float>(r * 10 + i));
    }
  }

  Manifest Save(uint64_t step, bool full = false) {
    IncrementChain::Step s;
    s.full = full;
    for (uint32_t r = 0; r < kWorld; ++r) {
      s.pieces["emb"].push_back(Floats(emb[r]));
      s.pieces["w"].push_back(Floats(w[r]));
      s.train_state.push_back({{"tok", std::string(300, static_cast<char>('a' + r))},
                               {"rng", "rng of step " + std::to_string(step)}});
    }
    saved[step] = s;
    return writer.Write(step, kRun, s);
  }

  // Steps 10 (full), 20 (rows 5 and 40 of rank 0's emb and rank 1's w changed) and 30 (row 6
  // of rank 0's emb): step 30 references chunks of both 10 and 20, one hop each.
  void Write() {
    Save(10);
    emb[0][5 * kCols] += 1;
    emb[0][40 * kCols + 3] += 1;
    w[1][2] += 1;
    Save(20);
    emb[0][6 * kCols + 1] += 1;
    Save(30);
  }
};

Manifest Load(CheckpointStore& store, uint64_t step) {
  absl::StatusOr<Manifest> m = store.LoadManifest(kJob, step);
  INFO((m.ok() ? "" : Message(m.status())));
  REQUIRE(m.ok());
  return *m;
}

// Every saved piece, by tensor then rank, into `out` (tests/fakes/read_saved.h).
absl::Status ReadSaved(CheckpointStore& store, const Manifest& m, std::map<std::string, std::vector<std::string>>& out,
                       PlanReader::HotLookup hot = {}) {
  CKPT_ASSIGN_OR_RETURN(out, testing::ReadSavedPieces(store.objects(), CheckpointStore::StepKey(kJob, m.step), m,
                                                      std::move(hot)));
  return absl::OkStatus();
}

void CheckReadsBack(Chain& c, uint64_t step) {
  Manifest m = Load(c.store, step);
  std::map<std::string, std::vector<std::string>> got;
  absl::Status read = ReadSaved(c.store, m, got);
  INFO(Message(read));
  REQUIRE(read.ok());
  CHECK(got == c.saved[step].pieces);
  PlanReader reader(c.store.objects(), CheckpointStore::StepKey(kJob, step), m, {});
  for (uint32_t r = 0; r < kWorld; ++r) {
    absl::StatusOr<std::vector<NamedBytes>> state = reader.TrainState(r);
    REQUIRE(state.ok());
    std::map<std::string, std::string> blobs;
    for (NamedBytes& b : *state) blobs[b.name] = b.data;
    CHECK(blobs == c.saved[step].train_state[r]);
  }
}

}  // namespace

TEST_CASE("a chain's manifests reference what did not change, one hop, and parse back as written") {
  Chain c;
  c.Write();
  Manifest m30 = Load(c.store, 30);
  CHECK(m30.format_version == kManifestIncrementFormatVersion);
  REQUIRE(m30.increment);
  CHECK(m30.increment->origin_steps == std::vector<StepRun>{{10, kRun}, {20, kRun}});
  // Rank 0's emb: chunk 1 (rows 4-7) written here, chunk 10 (rows 40-43) in 20, the rest in 10.
  const TensorShard& emb0 = m30.tensors.at("emb").shards[0];
  REQUIRE(emb0.extents.size() == 5);
  CHECK(emb0.extents[0] == Extent{0, 1, 10, emb0.extents[0].at});
  CHECK(emb0.extents[1] == Extent{1, 2, std::nullopt, 0});
  CHECK(emb0.extents[2].step == 10);
  CHECK(emb0.extents[3] == Extent{10, 11, 20, emb0.extents[3].at});
  CHECK(emb0.extents[4].step == 10);
  // Rank 1's w, one chunk unchanged since 20: referenced there; its tok since 10.
  CHECK(m30.tensors.at("w").shards[1].extents == std::vector<Extent>{{0, 1, 20, m30.tensors.at("w").shards[1].extents[0].at}});
  CHECK(m30.shards[1].train_state.at("tok").step == 10);
  CHECK_FALSE(m30.shards[1].train_state.at("rng").step);
  CHECK(m30.increment->own_bytes < m30.increment->referenced_bytes * 4);
  // Written again from what was parsed: the same text.
  std::ifstream in(c.writer.StepDir(30) + "/manifest.json", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(ManifestToJson(m30) == text);
  // ckptctl list: the own bytes, and what each step references besides.
  absl::StatusOr<std::vector<CheckpointSummary>> listed = ListCheckpoints(c.store, kJob);
  REQUIRE(listed.ok());
  REQUIRE(listed->size() == 3);
  CHECK((*listed)[0].referenced_bytes == 0);
  CHECK((*listed)[0].flags.empty());
  CHECK((*listed)[2].bytes == m30.increment->own_bytes);
  CHECK((*listed)[2].referenced_bytes == m30.increment->referenced_bytes);
  CHECK((*listed)[2].flags == std::vector<std::string>{"increment"});
  // A restore asks whether this node holds a rank's file of a step: the tagged name counts.
  CHECK(c.store.HasRankFile(kJob, 30, 1));
  CHECK_FALSE(c.store.HasRankFile(kJob, 30, 2));
}

TEST_CASE("every step of a chain reads back bit-exact in the saved placement, train state too") {
  Chain c;
  c.Write();
  for (uint64_t step : {10, 20, 30}) {
    INFO("step " << step);
    CheckReadsBack(c, step);
  }
}

TEST_CASE("a chain reads back in other placements: 1, 3 and 8 ranks, rows and columns") {
  Chain c;
  c.Write();
  Manifest m = Load(c.store, 30);
  std::vector<float> whole;
  for (uint32_t r = 0; r < kWorld; ++r) whole.insert(whole.end(), c.emb[r].begin(), c.emb[r].end());
  const int64_t rows = kWorld * kRows;
  for (int ranks : {1, 3, 8}) {
    for (bool by_column : {false, true}) {
      INFO(ranks << " ranks, split by " << (by_column ? "column" : "row"));
      PlanReader reader(c.store.objects(), CheckpointStore::StepKey(kJob, 30), m, {});
      const int64_t along = by_column ? kCols : rows;
      for (int k = 0; k < ranks; ++k) {
        const int64_t begin = along * k / ranks, end = along * (k + 1) / ranks;
        WantedTensor want{"emb", "F32", {}, {rows, kCols}, {}, {}, std::nullopt};
        want.shape = by_column ? std::vector<int64_t>{rows, end - begin} : std::vector<int64_t>{end - begin, kCols};
        want.offset = by_column ? std::vector<int64_t>{0, begin} : std::vector<int64_t>{begin, 0};
        absl::StatusOr<ReadPlan> plan = PlanRead(m, {want});
        REQUIRE(plan.ok());
        REQUIRE(reader.Open(plan->tensors).ok());
        std::vector<float> got(plan->tensors[0].bytes / 4);
        absl::Status read = reader.Read(plan->tensors[0], reinterpret_cast<char*>(got.data()));
        INFO(Message(read));
        REQUIRE(read.ok());
        for (int64_t i = 0; i < want.shape[0]; ++i) {
          for (int64_t j = 0; j < want.shape[1]; ++j) {
            const float expected = whole[(want.offset[0] + i) * kCols + want.offset[1] + j];
            if (got[i * want.shape[1] + j] != expected) FAIL("element [" << i << ", " << j << "] differs");
          }
        }
      }
    }
  }
}

TEST_CASE("a step read from ckptd's memory takes each piece by name and size, whatever the file's layout") {
  Chain c;
  c.Write();
  Manifest m = Load(c.store, 30);
  // The snapshot rank 0 was written from: its pieces in staging order (w before emb), which
  // is not the order of the step's own file.
  // Each in a place of its own, as a frozen block's tensors are.
  const std::string& w = c.saved[30].pieces["w"][0];
  const std::string& emb = c.saved[30].pieces["emb"][0];
  ckpt::ScatteredBytes region;
  region.Append(w.data(), w.size());
  region.Append(emb.data(), emb.size());
  std::vector<TensorEntry> entries = {{"w", "F32", {2, 4}, 0, 32}, {"emb", "F32", {kRows, kCols}, 32, region.size()}};
  std::vector<std::string> names;
  auto hot = [&](uint32_t rank) -> std::optional<MemoryShard> {
    if (rank != 0) return std::nullopt;
    return MemoryShard{nullptr, &region, &entries, entries.size(), &names};
  };
  std::map<std::string, std::vector<std::string>> got;
  REQUIRE(ReadSaved(c.store, m, got, hot).ok());
  CHECK(got == c.saved[30].pieces);
}

TEST_CASE("verify checks a step's own files and every chunk it references") {
  Chain c;
  c.Write();
  absl::StatusOr<VerifyReport> report = VerifyCheckpoint(c.store, kJob, 30);
  REQUIRE(report.ok());
  INFO(fmt::format("{}", fmt::join(report->problems, "\n")));
  CHECK(report->ok());
  Manifest m = Load(c.store, 30);
  CHECK(report->bytes_referenced == m.increment->referenced_bytes);
  CHECK(report->referenced_files.size() == 4);  // steps 10 and 20, each rank's
}

TEST_CASE("an origin retired to its held directory is still read") {
  Chain c;
  c.Write();
  fs::rename(c.writer.StepDir(10), c.dir.path() + "/" + kJob + "/" + HeldStepDirName(10, kRun));
  CheckReadsBack(c, 30);
  absl::StatusOr<VerifyReport> report = VerifyCheckpoint(c.store, kJob, 30);
  REQUIRE(report.ok());
  CHECK(report->ok());
  bool held = false;
  for (const std::string& file : report->referenced_files) held |= file.find(".held-") != std::string::npos;
  CHECK(held);
}

TEST_CASE("a damaged referenced chunk is found and named, by a restore and by verify") {
  Chain c;
  c.Write();
  Manifest m = Load(c.store, 30);
  const TensorShard& emb0 = m.tensors.at("emb").shards[0];
  // Row 20 of rank 0's emb (chunk 5): unchanged since step 10, read from its file there.
  testing::FlipDataBit(c.writer.FilePath(10, 0), emb0.extents[2].at + kChunk * (5 - emb0.extents[2].chunk_begin) + 7);
  std::map<std::string, std::vector<std::string>> got;
  absl::Status read = ReadSaved(c.store, m, got);
  INFO(Message(read));
  CHECK(absl::IsDataLoss(read));
  CHECK_THAT(Message(read), Catch::Contains("referenced in step 10") && Catch::Contains("checksum mismatch") &&
                                Catch::Contains("step-00000010/rank-00000."));
  absl::StatusOr<VerifyReport> report = VerifyCheckpoint(c.store, kJob, 30);
  REQUIRE(report.ok());
  REQUIRE(report->problems.size() == 1);
  CHECK_THAT(report->problems[0], Catch::Contains("tensor emb (its chunks [2, 10), referenced in step 10)"));
}

TEST_CASE("a missing or replaced origin file is damage, named with where it was looked for") {
  Chain c;
  c.Write();
  Manifest m = Load(c.store, 30);
  std::map<std::string, std::vector<std::string>> got;
  SECTION("missing") {
    fs::remove_all(c.writer.StepDir(10));
    absl::Status read = ReadSaved(c.store, m, got);
    CHECK(absl::IsDataLoss(read));
    CHECK_THAT(Message(read), Catch::Contains("which step 30 references, is missing") &&
                                  Catch::Contains("step-00000010/rank-0000") &&
                                  Catch::Contains("step-00000010.held-18f3a9c2d4e5b600/rank-0000"));
  }
  SECTION("another size") {
    std::ofstream(c.writer.FilePath(20, 1), std::ios::app) << "x";
    absl::Status read = ReadSaved(c.store, m, got);
    CHECK(absl::IsDataLoss(read));
    CHECK_THAT(Message(read), Catch::Contains("extended") && Catch::Contains("which step 30 references"));
  }
  absl::StatusOr<VerifyReport> report = VerifyCheckpoint(c.store, kJob, 30);
  REQUIRE(report.ok());
  CHECK_FALSE(report->ok());
}

TEST_CASE("an extent that points across entries or at another tensor's bytes is refused before use") {
  Chain c;
  c.Write();
  Manifest m = Load(c.store, 30);
  // Rank 1's w references step 20's w, the first entry of that file (32 bytes), then its
  // train state: a manifest that still parses (it is well formed) but names other bytes.
  TensorShard& w1 = m.tensors.at("w").shards[1];
  REQUIRE(w1.extents[0].at == 0);
  SECTION("the next entry") { w1.extents[0].at = 32; }
  SECTION("across two entries") { w1.extents[0].at = 16; }
  std::map<std::string, std::vector<std::string>> got;
  absl::Status read = ReadSaved(c.store, m, got);
  INFO(Message(read));
  CHECK(absl::IsDataLoss(read));
  CHECK_THAT(Message(read), Catch::Contains("are not inside one F32 entry of the tensor"));
}

TEST_CASE("an incremental step exports the same Hugging Face tensors as the full step of the same state") {
  Chain c;
  c.Write();
  c.Save(40, /*full=*/true);  // step 30's state, written whole
  auto exported = [&](uint64_t step) {
    Manifest m = Load(c.store, step);
    exporter::ExportOptions options;
    options.format = exporter::ExportFormat::kSafetensors;
    options.out = c.dir.path() + "/export-" + std::to_string(step) + ".safetensors";
    auto fs = MakePosixFilesystem();
    absl::StatusOr<exporter::ExportReport> report =
        exporter::ExportStep(*fs, c.store.objects(), CheckpointStore::StepKey(kJob, step), m, options);
    INFO((report.ok() ? "" : Message(report.status())));
    REQUIRE(report.ok());
    CHECK(report->tensors == 2);
    std::ifstream in(options.out, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  CHECK(exported(30) == exported(40));
}
