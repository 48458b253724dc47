// The manifest an incremental step is sealed with at its peers (issue 48, step 7): its pieces
// and train state where the rank's staged snapshot holds them, which is what the peers code
// and a lost node rebuilds; RebuiltSnapshot reads it and checks every byte. The step's own
// manifest (referenced pieces, a referenced blob, own pieces in the increment's file) would
// place nothing in the rebuilt shard, and is refused by name.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/restore/rebuilt_snapshot.h"
#include "daemon/restore/snapshot_manifest.h"
#include "daemon/staging/staged_snapshot.h"
#include "format/checksum.h"
#include "format/manifest.h"

using ckpt::daemon::RebuiltSnapshot;
using ckpt::daemon::SnapshotManifest;
using ckpt::daemon::StagedSnapshot;
using ckpt::daemon::StagedSnapshotPtr;
using namespace ckpt::format;

namespace {

constexpr uint64_t kTag = 0x18f3a9c2d4e5b6a8;
constexpr uint64_t kOriginTag = 0x18f3a9c2d4e5b6a7;
constexpr uint64_t kRun = 7;

// Rank 1's staged snapshot: "w" F32 [4, 8] at [0, 128), "emb" F32 [16, 4] at [128, 384),
// "b" F32 [8] at [384, 416), train state "optimizer" at [416, 480) and "tokenizer" at
// [480, 544).
constexpr uint64_t kSnapshotBytes = 544;

std::string Data() {
  std::string data(kSnapshotBytes, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 29 + 3);
  return data;
}

std::string Sum(const std::string& data, uint64_t begin, uint64_t end) {
  return ChecksumOf(data.data() + begin, end - begin);
}

StagedSnapshotPtr Snapshot(const std::string& data) {
  auto snap = std::make_shared<StagedSnapshot>();
  snap->job = "llm";
  snap->step = 30;
  snap->rank = 1;
  snap->world_size = 2;
  snap->shard.rank = 1;
  snap->shard.region = ckpt::ScatteredBytes(data.data(), data.size());
  snap->shard.data_bytes = data.size();
  snap->shard.entries = {{"w", "F32", {4, 8}, 0, 128},
                         {"emb", "F32", {16, 4}, 128, 384},
                         {"b", "F32", {8}, 384, 416},
                         {TrainStateKey("optimizer"), "U8", {64}, 416, 480},
                         {TrainStateKey("tokenizer"), "U8", {64}, 480, 544}};
  snap->tensor_count = 3;
  snap->train_state_names = {"optimizer", "tokenizer"};
  return snap;
}

// Node 1's committed manifest of step 30 (node-scoped, format version 5) as the writer
// made it: "w" referenced whole in step 10, "emb" in step 10 but its chunk 1 (in this step's
// file at 0, a __delta__ entry), "b" written whole in this step's file at [64, 96),
// "optimizer" in this step's file at [96, 160), "tokenizer" referenced in step 10.
Manifest Committed(const std::string& data) {
  Manifest m;
  m.job = "llm";
  m.step = 30;
  m.world_size = 2;
  m.run = kRun;
  m.unix_time = 1.5e9;
  m.wall_time = "2026-11-29T10:00:00Z";
  m.ckptd_version = "test";
  m.checksum_chunk_bytes = kChecksumChunkBytes;
  m.scope = StepScope{.node = 1, .nodes = 2, .step_bytes = 4096 + 160 + 9000, .step_tensors = 3,
                      .digest = "xxh3:0123456789abcdef"};
  m.nodes = {{1, {1}}};
  ManifestShard s;
  s.rank = 1;
  s.file = TaggedShardFileName(1, kTag);
  s.bytes = 4096 + 160;
  s.train_state["optimizer"] = TrainStateEntry{96, 160, Sum(data, 416, 480), std::nullopt};
  s.train_state["tokenizer"] = TrainStateEntry{3000, 3064, Sum(data, 480, 544), 10};
  m.shards.push_back(s);

  TensorShard w;
  w.rank = 1;
  w.offset = {4, 0};
  w.shape = {4, 8};
  w.checksum = Sum(data, 0, 128);
  w.chunk_bytes = 64;
  w.chunk_checksums = {Sum(data, 0, 64), Sum(data, 64, 128)};
  w.extents = {{0, 2, 10, 1000}};
  m.tensors["w"] = {"F32", {8, 8}, {w}};

  TensorShard emb;
  emb.rank = 1;
  emb.offset = {16, 0};
  emb.shape = {16, 4};
  emb.checksum = Sum(data, 128, 384);
  emb.chunk_bytes = 64;
  for (uint64_t c = 0; c < 4; ++c) emb.chunk_checksums.push_back(Sum(data, 128 + 64 * c, 192 + 64 * c));
  emb.extents = {{0, 1, 10, 2000}, {1, 2, std::nullopt, 0}, {2, 4, 10, 2128}};
  m.tensors["emb"] = {"F32", {32, 4}, {emb}};

  TensorShard b;
  b.rank = 1;
  b.file = s.file;
  b.begin = 64;
  b.end = 96;
  b.flat = {{8, 16}};
  b.shape = {8};
  b.checksum = Sum(data, 384, 416);
  b.chunk_bytes = 32;
  m.tensors["b"] = {"F32", {16}, {b}};

  m.increment = Increment{};
  m.increment->own_bytes = 4096 + 160 + 5000;
  m.increment->referenced_bytes = 500;
  m.increment->origin_steps = {{10, kRun}};
  m.increment->origins = {{10, kRun, 1, TaggedShardFileName(1, kOriginTag), 8192}};
  return m;
}

ckpt::daemon::ShardBytes Held(const std::string& bytes) {
  auto copy = std::make_shared<std::string>(bytes);
  return {std::shared_ptr<const char>(copy, copy->data()), copy->size()};
}

}  // namespace

TEST_CASE("an incremental step is sealed with its pieces where the staged snapshot holds them") {
  const std::string data = Data();
  const Manifest committed = Committed(data);
  // What the test starts from is a manifest every reader accepts.
  {
    absl::StatusOr<Manifest> parsed = ParseManifest(ManifestToJson(committed), "the committed manifest");
    INFO(parsed.status());
    REQUIRE(parsed.ok());
  }
  absl::StatusOr<Manifest> sealed = SnapshotManifest(committed, {Snapshot(data)});
  INFO(sealed.status());
  REQUIRE(sealed.ok());

  // Every piece whole at the snapshot's offsets, in the rank's (tagged) file; checksums as
  // committed, chunk size and all.
  const TensorShard& w = sealed->tensors.at("w").shards.at(0);
  CHECK(w.extents.empty());
  CHECK(w.file == TaggedShardFileName(1, kTag));
  CHECK(w.begin == 0);
  CHECK(w.end == 128);
  CHECK(w.chunk_bytes == 64);
  CHECK(w.chunk_checksums == committed.tensors.at("w").shards[0].chunk_checksums);
  CHECK(w.checksum == committed.tensors.at("w").shards[0].checksum);
  const TensorShard& emb = sealed->tensors.at("emb").shards.at(0);
  CHECK(emb.extents.empty());
  CHECK(emb.begin == 128);
  CHECK(emb.end == 384);
  CHECK(emb.chunk_checksums.size() == 4);
  const TensorShard& b = sealed->tensors.at("b").shards.at(0);
  CHECK(b.begin == 384);
  CHECK(b.end == 416);
  CHECK(b.flat == std::vector<ElementRange>{{8, 16}});
  // Train state at the snapshot's offsets, the referenced blob no longer referenced.
  const ManifestShard& shard = sealed->shards.at(0);
  CHECK(shard.bytes == kSnapshotBytes);
  CHECK(shard.file == TaggedShardFileName(1, kTag));
  CHECK(shard.train_state.at("optimizer").begin == 416);
  CHECK(shard.train_state.at("optimizer").end == 480);
  CHECK_FALSE(shard.train_state.at("tokenizer").step.has_value());
  CHECK(shard.train_state.at("tokenizer").begin == 480);
  CHECK(shard.train_state.at("tokenizer").end == 544);
  // Nothing referenced; the step's bytes count this node's rank at its snapshot's size.
  REQUIRE(sealed->increment.has_value());
  CHECK(sealed->increment->origins.empty());
  CHECK(sealed->increment->origin_steps.empty());
  CHECK(sealed->increment->referenced_bytes == 0);
  REQUIRE(sealed->scope.has_value());
  CHECK(sealed->scope->step_bytes == 9000 + kSnapshotBytes);
  CHECK(sealed->increment->own_bytes == sealed->scope->step_bytes);

  // As a peer hands it to the replacement: version 5 text that ParseManifest accepts, and a
  // rebuilt shard that RebuiltSnapshot checks byte for byte.
  const std::string json = ManifestToJson(*sealed);
  absl::StatusOr<Manifest> parsed = ParseManifest(json, "a peer's copy of this node's manifest");
  INFO(parsed.status());
  REQUIRE(parsed.ok());
  CHECK(parsed->format_version == 5);
  absl::StatusOr<StagedSnapshotPtr> rebuilt = RebuiltSnapshot(*parsed, 1, Held(data));
  INFO(rebuilt.status());
  REQUIRE(rebuilt.ok());
  REQUIRE((*rebuilt)->tensor_count == 3);
  const StagedSnapshotPtr snap = Snapshot(data);
  for (size_t i = 0; i < (*rebuilt)->shard.entries.size(); ++i) {
    const TensorEntry& got = (*rebuilt)->shard.entries[i];
    const TensorEntry& staged = snap->shard.entries[i];
    INFO(staged.name);
    CHECK(got.begin == staged.begin);
    CHECK(got.end == staged.end);
  }
  CHECK((*rebuilt)->train_state_names == std::vector<std::string>{"optimizer", "tokenizer"});

  // Every byte is checked: one flipped in what the step referenced (w, the tokenizer) or in
  // what it wrote itself (emb's chunk 1) is found.
  for (uint64_t at : {5u, 200u, 500u}) {
    std::string damaged = data;
    damaged[at] ^= 0x10;
    INFO("byte " << at);
    CHECK(absl::IsDataLoss(RebuiltSnapshot(*parsed, 1, Held(damaged)).status()));
  }
}

TEST_CASE("the committed manifest of an incremental step is refused by RebuiltSnapshot, naming why") {
  const std::string data = Data();
  Manifest committed = Committed(data);
  committed.tensors.erase("b");  // at its own file's offsets: those bytes would not match first
  auto made = RebuiltSnapshot(committed, 1, Held(data));
  CHECK(absl::IsFailedPrecondition(made.status()));
  CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("referenced in other steps' files"));
  // A referenced train-state blob alone is refused as well.
  committed.tensors.clear();
  committed.shards[0].train_state.erase("optimizer");
  made = RebuiltSnapshot(committed, 1, Held(data));
  CHECK(absl::IsFailedPrecondition(made.status()));
  CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("train state tokenizer") && Catch::Contains("step 10"));
}

TEST_CASE("a manifest without increments is sealed as committed; a snapshot unlike it is refused") {
  const std::string data = Data();
  SECTION("versions 1-4: the file's data region is the snapshot") {
    Manifest full = Committed(data);
    full.increment.reset();
    absl::StatusOr<Manifest> sealed = SnapshotManifest(full, {});
    REQUIRE(sealed.ok());
    CHECK(ManifestToJson(*sealed) == ManifestToJson(full));
  }
  SECTION("a rank without its snapshot") {
    auto sealed = SnapshotManifest(Committed(data), {});
    CHECK(absl::IsFailedPrecondition(sealed.status()));
    CHECK_THAT(ckpt::Message(sealed.status()), Catch::Contains("rank 1"));
  }
  SECTION("a piece the snapshot holds at another size") {
    StagedSnapshotPtr snap = Snapshot(data);
    snap->shard.entries[1].end -= 4;
    auto sealed = SnapshotManifest(Committed(data), {snap});
    CHECK(absl::IsFailedPrecondition(sealed.status()));
    CHECK_THAT(ckpt::Message(sealed.status()), Catch::Contains("tensor emb"));
  }
  SECTION("a train-state blob the snapshot lacks") {
    StagedSnapshotPtr snap = Snapshot(data);
    snap->train_state_names[1] = "other";
    auto sealed = SnapshotManifest(Committed(data), {snap});
    CHECK(absl::IsFailedPrecondition(sealed.status()));
    CHECK_THAT(ckpt::Message(sealed.status()), Catch::Contains("train state tokenizer"));
  }
}
