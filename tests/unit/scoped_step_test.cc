// A step saved by a group of two nodes with node-local disks: node 0 keeps the whole step's
// manifest, node 1 a node-scoped one of its own ranks. What node 1's readers make of it:
// list, verify, and restores through the read planner.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/persist/shard_writer.h"
#include "format/checkpoint_store.h"
#include "format/manifest.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "format/verify.h"
#include "storage/filesystem.h"
#include "tests/fakes/flip_bit.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;
using namespace ckpt::format;
using ckpt::persist::StagedShard;
using ckpt::persist::WrittenShard;

namespace {

constexpr uint32_t kWorld = 4;
constexpr int64_t kRow = 256;  // "w" is [kWorld, kRow] F32, one row per rank
constexpr uint64_t kStep = 5;
const std::string kJob = "job";

// Node 0 holds ranks 0 and 3, node 1 ranks 1 and 2.
uint32_t NodeOf(uint32_t rank) { return rank == 1 || rank == 2 ? 1 : 0; }

struct TwoNodes {
  testing::TempDir dirs[2];
  CheckpointStore stores[2] = {CheckpointStore(MakePosixFilesystem(), dirs[0].path()),
                               CheckpointStore(MakePosixFilesystem(), dirs[1].path())};
  std::vector<float> rows[kWorld];
  Manifest whole;
  Manifest scoped;  // node 1's

  TwoNodes() {
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kRow; ++i) rows[r].push_back(static_cast<float>(r * 1000 + i));
    }
  }

  static std::string Rng(uint32_t rank) { return "rng-of-" + std::to_string(rank); }

  // Writes `rank`'s shard into its node's step directory: the row, then a train-state blob.
  absl::StatusOr<WrittenShard> Write(uint32_t rank) {
    std::string region(kRow * sizeof(float), '\0');
    std::memcpy(region.data(), rows[rank].data(), region.size());
    region += Rng(rank);
    StagedShard shard;
    shard.rank = rank;
    shard.region = ScatteredBytes(region.data(), region.size());
    shard.data_bytes = region.size();
    const uint64_t row_bytes = kRow * sizeof(float);
    shard.entries = {{"w", "F32", {1, kRow}, 0, row_bytes},
                     {TrainStateKey("rng"), "U8", {static_cast<int64_t>(Rng(rank).size())}, row_bytes,
                      region.size()}};
    shard.metadata = {{"rank", std::to_string(rank)}};
    CheckpointStore& store = stores[NodeOf(rank)];
    return persist::MakeShardWriter(store.objects_ptr())->Write(shard, store.TempStepKey(kJob, kStep));
  }

  absl::Status Save() {
    for (CheckpointStore& store : stores) CKPT_RETURN_IF_ERROR(store.BeginStep(kJob, kStep));
    whole.job = kJob;
    whole.step = kStep;
    whole.world_size = kWorld;
    whole.ckptd_version = "test";
    whole.unix_time = 1.7e9;
    whole.wall_time = "2026-01-01T00:00:00Z";
    whole.checksum_chunk_bytes = kChecksumChunkBytes;
    whole.tensors["w"] = {"F32", {kWorld, kRow}, {}};
    for (uint32_t r = 0; r < kWorld; ++r) {
      CKPT_ASSIGN_OR_RETURN(WrittenShard written, Write(r));
      const uint64_t row_bytes = kRow * sizeof(float);
      ManifestShard shard{r, written.file, written.bytes, {{"rank", std::to_string(r)}}, {}};
      shard.train_state["rng"] = {row_bytes, row_bytes + Rng(r).size(),
                                  written.checksums.at(TrainStateKey("rng"))};
      if (r == 0) whole.metadata = shard.metadata;
      whole.shards.push_back(std::move(shard));
      whole.tensors["w"].shards.push_back(
          {r, written.file, 0, row_bytes, {int64_t{r}, 0}, {1, kRow}, written.checksums.at("w"), {}, {}});
    }
    whole.nodes = {{0, {0, 3}}, {1, {1, 2}}};
    // Node 1's cut of it, as the daemon writes it: its ranks, and the whole step's figures.
    scoped = whole;
    std::erase_if(scoped.shards, [](const ManifestShard& s) { return NodeOf(s.rank) != 1; });
    std::erase_if(scoped.tensors.at("w").shards, [](const TensorShard& s) { return NodeOf(s.rank) != 1; });
    scoped.nodes = {{1, {1, 2}}};
    scoped.scope = StepScope{1, 2, whole.total_bytes(), static_cast<uint32_t>(whole.tensors.size()),
                             ManifestDigest(ManifestToJson(whole))};
    CKPT_RETURN_IF_ERROR(stores[0].Commit(whole));
    return stores[1].Commit(scoped);
  }

  CheckpointStore& node1() { return stores[1]; }
};

WantedTensor Row(uint32_t rank, int64_t rows = 1) {
  return {"w", "F32", {rows, kRow}, {kWorld, kRow}, {int64_t{rank}, 0}, {}, std::nullopt};
}

}  // namespace

TEST_CASE("node 1 loads its node-scoped manifest, which tiles no tensor by itself") {
  TwoNodes g;
  REQUIRE(g.Save().ok());
  auto manifest = g.node1().LoadManifest(kJob, kStep);
  REQUIRE(manifest.ok());
  REQUIRE(manifest->scope.has_value());
  CHECK(manifest->shards.size() == 2);
  CHECK(manifest->Shard(2) != nullptr);
  CHECK(manifest->Shard(3) == nullptr);
  // The digest names node 0's manifest as committed, byte for byte.
  auto text = g.stores[0].objects().Get(CheckpointStore::StepKey(kJob, kStep) + "/manifest.json",
                                         CheckpointStore::kMaxManifestBytes);
  REQUIRE(text.ok());
  CHECK(manifest->scope->digest == ManifestDigest(*text));
}

TEST_CASE("every node lists the whole step's bytes and tensors") {
  TwoNodes g;
  REQUIRE(g.Save().ok());
  auto on_node0 = ListCheckpoints(g.stores[0], kJob);
  auto on_node1 = ListCheckpoints(g.node1(), kJob);
  REQUIRE(on_node0.ok());
  REQUIRE(on_node1.ok());
  REQUIRE(on_node0->size() == 1);
  REQUIRE(on_node1->size() == 1);
  const CheckpointSummary& here = on_node1->front();
  CHECK(here.error.empty());
  CHECK(here.world_size == kWorld);
  CHECK(here.bytes == g.whole.total_bytes());
  CHECK(here.bytes > g.scoped.total_bytes());
  CHECK(here.tensors == 1);
  CHECK(here.bytes == on_node0->front().bytes);
  CHECK(here.tensors == on_node0->front().tensors);
}

TEST_CASE("verify on node 1 checks its own ranks and skips the other node's") {
  TwoNodes g;
  REQUIRE(g.Save().ok());
  auto report = VerifyCheckpoint(g.node1(), kJob, kStep);
  REQUIRE(report.ok());
  CHECK(report->ok());
  CHECK(report->skipped_ranks == std::vector<uint32_t>{0, 3});
  CHECK(report->bytes_checked == g.scoped.shards[0].train_state.at("rng").end +
                                     g.scoped.shards[1].train_state.at("rng").end);

  // A bad disk under rank 2's row.
  testing::FlipDataBit(g.dirs[1] / (CheckpointStore::StepKey(kJob, kStep) + "/" + ShardFileName(2)), 40);
  auto damaged = VerifyCheckpoint(g.node1(), kJob, kStep);
  REQUIRE(damaged.ok());
  REQUIRE(damaged->problems.size() == 1);
  CHECK_THAT(damaged->problems[0], Catch::Contains(ShardFileName(2)));
  CHECK(damaged->skipped_ranks == std::vector<uint32_t>{0, 3});
}

TEST_CASE("a restore on node 1 reads its own ranks from the scoped manifest") {
  TwoNodes g;
  REQUIRE(g.Save().ok());
  auto manifest = g.node1().LoadManifest(kJob, kStep);
  REQUIRE(manifest.ok());
  // Rank 2 in its saved placement, and rows 1..2 as one piece (another placement, still
  // only this node's ranks).
  auto plan = PlanRead(*manifest, {Row(2), Row(1, 2)});
  REQUIRE(plan.ok());
  REQUIRE(plan->tensors.size() == 2);
  CHECK(plan->tensors[0].whole_entry());
  CHECK(plan->tensors[1].reads.size() == 2);
  PlanReader reader(g.node1().objects(), CheckpointStore::StepKey(kJob, kStep), *manifest, {});
  REQUIRE(reader.Open(plan->tensors).ok());
  std::vector<float> row(kRow), two_rows(2 * kRow);
  REQUIRE(reader.Read(plan->tensors[0], reinterpret_cast<char*>(row.data())).ok());
  CHECK(row == g.rows[2]);
  REQUIRE(reader.Read(plan->tensors[1], reinterpret_cast<char*>(two_rows.data())).ok());
  CHECK(std::equal(g.rows[1].begin(), g.rows[1].end(), two_rows.begin()));
  CHECK(std::equal(g.rows[2].begin(), g.rows[2].end(), two_rows.begin() + kRow));
  auto state = reader.TrainState(1);
  REQUIRE(state.ok());
  REQUIRE(state->size() == 1);
  CHECK(state->front().data == TwoNodes::Rng(1));
  // A rank the step was not saved with (the job grew) has no state, as from a whole manifest.
  auto grown = reader.TrainState(kWorld);
  REQUIRE(grown.ok());
  CHECK(grown->empty());
}

TEST_CASE("a restore on node 1 of a rank node 0 holds is refused, saying where it is") {
  TwoNodes g;
  REQUIRE(g.Save().ok());
  auto manifest = g.node1().LoadManifest(kJob, kStep);
  REQUIRE(manifest.ok());
  // Rank 3's row, and the whole tensor: neither lies on this node alone.
  for (const WantedTensor& wanted : {Row(3), Row(0, kWorld)}) {
    auto plan = PlanRead(*manifest, {wanted});
    REQUIRE_FALSE(plan.ok());
    CHECK(absl::IsInvalidArgument(plan.status()));
    CHECK_THAT(Message(plan.status()), Catch::Contains("no saved shard holds"));
    CHECK_THAT(Message(plan.status()), Catch::Contains("node 1's manifest lists only its own ranks (2 of 4)"));
    CHECK_THAT(Message(plan.status()), Catch::Contains("held by other nodes"));
  }
  // Of a tensor it does not list, a scoped manifest cannot say the step lacks it.
  Manifest fewer = *manifest;
  fewer.scope->step_tensors = 2;
  ReadPlanOptions lenient;
  lenient.allow_missing = true;
  auto missing = PlanRead(fewer, {{"bias", "F32", {4}, {}, {}, {}, std::nullopt}}, lenient);
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(Message(missing.status()), Catch::Contains("bias: node 1's manifest lists only its own ranks"));
  // When it lists every tensor of the step, one it lacks is missing from the step.
  auto skipped = PlanRead(*manifest, {{"bias", "F32", {4}, {}, {}, {}, std::nullopt}}, lenient);
  REQUIRE(skipped.ok());
  CHECK(skipped->missing == std::vector<std::string>{"bias"});

  PlanReader reader(g.node1().objects(), CheckpointStore::StepKey(kJob, kStep), *manifest, {});
  auto state = reader.TrainState(3);
  REQUIRE_FALSE(state.ok());
  CHECK(absl::IsNotFound(state.status()));
  CHECK_THAT(Message(state.status()), Catch::Contains("rank 3's shard of step 5 is held by another node"));
  // A plan made elsewhere (from node 0's manifest) that reads rank 0's file.
  TensorReadPlan foreign{"w", kRow * sizeof(float), {{0, ShardFileName(0), 0, kRow * sizeof(float), "", {},
                                                      {{0, 0, kRow * sizeof(float)}}}}};
  std::vector<float> row(kRow);
  absl::Status read = reader.Read(foreign, reinterpret_cast<char*>(row.data()));
  CHECK(absl::IsNotFound(read));
  CHECK_THAT(Message(read), Catch::Contains("rank 0's shard of step 5 is held by another node"));
  CHECK_THAT(Message(read), Catch::Contains("node 0's manifest or the remote tier's"));
}
