// A rank's shard rebuilt from peers as the snapshot hot restore reads (issue 25): its entries
// where this node's manifest of the step puts them, in data order, every tensor and
// train-state blob checked against the manifest's checksum first.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/restore/rebuilt_snapshot.h"
#include "daemon/staging/staged_snapshot.h"
#include "format/checksum.h"
#include "format/manifest.h"

using ckpt::daemon::RebuiltSnapshot;
using ckpt::daemon::StagedSnapshotPtr;
using namespace ckpt::format;

namespace {

// Rank 1's data region: tensor "w" (F32 [2, 8], rows 2..3 of a [4, 8]) at [0, 64), tensor
// "b" (F32, elements 8..15 of a flat [16]) at [64, 96), train state "optimizer" at
// [96, 160), and 8 bytes after them.
constexpr uint64_t kDataBytes = 168;

std::string Data() {
  std::string data(kDataBytes, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 37 + 11);
  return data;
}

std::string Sum(const std::string& data, uint64_t begin, uint64_t end) {
  return ChecksumOf(data.data() + begin, end - begin);
}

Manifest Make(const std::string& data) {
  Manifest m;
  m.job = "llm";
  m.step = 42;
  m.world_size = 2;
  m.run = 5;
  for (uint32_t rank : {0u, 1u}) {
    ManifestShard s;
    s.rank = rank;
    s.file = ShardFileName(rank);
    s.bytes = rank == 1 ? kDataBytes : 500;
    s.metadata = {{"rank", std::to_string(rank)}};
    m.shards.push_back(s);
  }
  m.shards[1].train_state["optimizer"] = TrainStateEntry{96, 160, Sum(data, 96, 160)};
  m.shards[0].train_state["optimizer"] = TrainStateEntry{0, 64, "xxh3:0000000000000000"};  // rank 0's: not read

  ManifestTensor w;
  w.dtype = "F32";
  w.global_shape = {4, 8};
  TensorShard w0;  // rank 0's piece: another rank's data, never checked here
  w0.rank = 0;
  w0.file = ShardFileName(0);
  w0.begin = 100;
  w0.end = 164;
  w0.offset = {0, 0};
  w0.shape = {2, 8};
  w0.checksum = "xxh3:0000000000000000";
  TensorShard w1;
  w1.rank = 1;
  w1.file = ShardFileName(1);
  w1.begin = 0;
  w1.end = 64;
  w1.offset = {2, 0};
  w1.shape = {2, 8};
  w1.checksum = Sum(data, 0, 64);
  w.shards = {w0, w1};
  m.tensors["w"] = w;

  ManifestTensor b;
  b.dtype = "F32";
  b.global_shape = {16};
  TensorShard b0;
  b0.rank = 0;
  b0.file = ShardFileName(0);
  b0.begin = 0;
  b0.end = 32;
  b0.shape = {8};
  b0.flat = {{0, 8}};
  b0.checksum = "xxh3:0000000000000000";
  TensorShard b1;
  b1.rank = 1;
  b1.file = ShardFileName(1);
  b1.begin = 64;
  b1.end = 96;
  b1.shape = {8};
  b1.flat = {{8, 16}};
  b1.checksum = Sum(data, 64, 96);
  b.shards = {b0, b1};
  m.tensors["b"] = b;
  return m;
}

// Bytes as the peers' restore hands them over: a buffer of their own.
ckpt::daemon::ShardBytes Held(const std::string& bytes) {
  auto copy = std::make_shared<std::string>(bytes);
  return {std::shared_ptr<const char>(copy, copy->data()), copy->size()};
}

}  // namespace

TEST_CASE("a rebuilt shard becomes a snapshot of the rank's entries in data order, placed as saved") {
  const std::string data = Data();
  const Manifest manifest = Make(data);
  ckpt::daemon::ShardBytes bytes = Held(data);
  absl::StatusOr<StagedSnapshotPtr> made = RebuiltSnapshot(manifest, 1, bytes);
  INFO(made.status());
  REQUIRE(made.ok());
  const auto& snap = **made;
  CHECK(snap.job == "llm");
  CHECK(snap.step == 42);
  CHECK(snap.rank == 1);
  CHECK(snap.world_size == 2);
  CHECK(snap.shard.rank == 1);
  CHECK(snap.shard.metadata == std::map<std::string, std::string>{{"rank", "1"}});
  CHECK(snap.shard.region.Contiguous(0, snap.shard.data_bytes) == bytes.data.get());
  CHECK(snap.shard.data_bytes == kDataBytes);
  CHECK(snap.rebuilt == bytes.data);
  CHECK(snap.block == nullptr);

  // Tensors first, in the order of their bytes ("w" before "b"), then the train state.
  CHECK(snap.tensor_count == 2);
  REQUIRE(snap.shard.entries.size() == 3);
  const TensorEntry& w = snap.shard.entries[0];
  CHECK(w.name == "w");
  CHECK(w.dtype == "F32");
  CHECK(w.shape == std::vector<int64_t>{2, 8});
  CHECK(w.begin == 0);
  CHECK(w.end == 64);
  const TensorEntry& b = snap.shard.entries[1];
  CHECK(b.name == "b");
  CHECK(b.dtype == "F32");
  CHECK(b.shape == std::vector<int64_t>{8});
  CHECK(b.begin == 64);
  CHECK(b.end == 96);
  const TensorEntry& state = snap.shard.entries[2];
  CHECK(state.dtype == "U8");
  CHECK(state.shape == std::vector<int64_t>{64});
  CHECK(state.begin == 96);
  CHECK(state.end == 160);
  CHECK(snap.train_state_names == std::vector<std::string>{"optimizer"});

  // The placements follow their entries.
  REQUIRE(snap.placements.size() == 2);
  CHECK(snap.placements[0].global_shape == std::vector<int64_t>{4, 8});
  CHECK(snap.placements[0].offset == std::vector<int64_t>{2, 0});
  CHECK(snap.placements[0].flat.empty());
  CHECK(snap.placements[1].global_shape == std::vector<int64_t>{16});
  CHECK(snap.placements[1].offset.empty());
  CHECK(snap.placements[1].flat == std::vector<ElementRange>{{8, 16}});
  // The bytes served are the rebuilt ones.
  CHECK(std::string(snap.shard.Data(b), b.end - b.begin) == data.substr(64, 32));
}

TEST_CASE("a rebuilt shard whose bytes differ from the manifest's checksums is refused naming the entry") {
  const std::string data = Data();
  const Manifest manifest = Make(data);
  SECTION("a byte of a tensor") {
    std::string damaged = data;
    damaged[70] ^= 0x01;  // inside "b"
    auto made = RebuiltSnapshot(manifest, 1, Held(damaged));
    CHECK(absl::IsDataLoss(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("tensor b") && Catch::Contains("step 42"));
  }
  SECTION("a byte of the train state") {
    std::string damaged = data;
    damaged[159] ^= 0x40;
    auto made = RebuiltSnapshot(manifest, 1, Held(damaged));
    CHECK(absl::IsDataLoss(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("train state optimizer"));
  }
  SECTION("a byte outside every entry is no entry's") {
    std::string changed = data;
    changed[165] ^= 0xff;
    CHECK(RebuiltSnapshot(manifest, 1, Held(changed)).ok());
  }
}

TEST_CASE("a rebuilt shard shorter than the manifest's pieces, or of a rank it does not list, is refused") {
  const std::string data = Data();
  SECTION("a tensor piece past the end of the data") {
    Manifest manifest = Make(data);
    manifest.tensors["w"].shards[1].end = kDataBytes + 8;
    auto made = RebuiltSnapshot(manifest, 1, Held(data));
    CHECK(absl::IsDataLoss(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("tensor w") && Catch::Contains("outside the rebuilt shard"));
  }
  SECTION("the data shorter than the train state") {
    const Manifest manifest = Make(data);
    auto made = RebuiltSnapshot(manifest, 1, Held(data.substr(0, 150)));
    CHECK(absl::IsDataLoss(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("train state optimizer") &&
                                                 Catch::Contains("outside the rebuilt shard of 150 bytes"));
  }
  SECTION("a piece that ends before it begins") {
    Manifest manifest = Make(data);
    manifest.tensors["b"].shards[1].begin = 96;
    manifest.tensors["b"].shards[1].end = 64;
    auto made = RebuiltSnapshot(manifest, 1, Held(data));
    CHECK(absl::IsDataLoss(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("tensor b"));
  }
  SECTION("a piece whose bytes are not what its dtype and shape make") {
    Manifest manifest = Make(data);
    manifest.tensors["w"].shards[1].shape = {2, 4};  // 32 bytes of F32, where the piece spans 64
    auto made = RebuiltSnapshot(manifest, 1, Held(data));
    CHECK(absl::IsDataLoss(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("tensor w of rank 1 spans 64 bytes"));
  }
  SECTION("a rank the manifest does not list") {
    const Manifest manifest = Make(data);
    auto made = RebuiltSnapshot(manifest, 2, Held(data));
    CHECK(absl::IsFailedPrecondition(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("no shard of rank 2"));
  }
  SECTION("two pieces of one tensor from the rank") {
    Manifest manifest = Make(data);
    TensorShard again = manifest.tensors["w"].shards[1];
    again.offset = {0, 0};
    manifest.tensors["w"].shards.push_back(again);
    auto made = RebuiltSnapshot(manifest, 1, Held(data));
    CHECK(absl::IsFailedPrecondition(made.status()));
    CHECK_THAT(ckpt::Message(made.status()), Catch::Contains("two pieces of tensor w"));
  }
}
