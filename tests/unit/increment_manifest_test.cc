// Format version 5 manifests (incremental steps): what they carry round-trips, and every
// way one could point a reader at the wrong bytes is refused by name.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "format/indexed_manifest.h"
#include "format/manifest.h"

using namespace ckpt::format;
using json = nlohmann::json;

namespace {

const std::string kChunk = "xxh3:00000000000000c1";

// Step 30 of 2 ranks: "emb" [8, 4] F32 (rank r rows 4r..4r+3, chunks of one row: 4 chunks),
// rank 0's referencing steps 10 and 20, rank 1's written whole; "tok" of rank 0 in step 10.
Manifest Sample() {
  Manifest m;
  m.job = "lora";
  m.step = 30;
  m.unix_time = 1.5e9;
  m.wall_time = "2026-11-29T06:00:00Z";
  m.world_size = 2;
  m.ckptd_version = "0.1.0";
  m.run = 5;
  Increment& inc = m.increment.emplace();
  inc.own_bytes = 4096 * 2 + 32;
  inc.referenced_bytes = 48 + 300;
  inc.origin_steps = {{10, 5}, {20, 5}};
  inc.origins = {{10, 5, 0, TaggedShardFileName(0, 0x5000), 9000}, {20, 5, 0, TaggedShardFileName(0, 0x5000), 5000}};
  for (uint32_t r = 0; r < 2; ++r) {
    m.shards.push_back({r, TaggedShardFileName(r, 0x5000 + r), 4096 + (r == 0 ? 16 : 64), {}, {}});
    m.tensors["emb"].dtype = "F32";
    m.tensors["emb"].global_shape = {8, 4};
    TensorShard piece{r, "", 0, 0, {4 * r, 0}, {4, 4}, "xxh3:0000000000000001",
                      {kChunk, kChunk, kChunk, kChunk}, {}, 16, {}};
    if (r == 0) {
      piece.extents = {{0, 2, 10, 4096}, {2, 3, std::nullopt, 0}, {3, 4, 20, 48}};
    } else {
      piece.file = m.shards[1].file;
      piece.begin = 0;
      piece.end = 64;
    }
    m.tensors["emb"].shards.push_back(piece);
  }
  m.shards[0].train_state["tok"] = {64, 364, "xxh3:00000000000000ab", 10};
  return m;
}

json Json(const Manifest& m) { return json::parse(ManifestToJson(m)); }

void RefusedFor(const json& j, const std::string& why) {
  absl::StatusOr<Manifest> parsed = ParseManifest(j.dump(), "m.json");
  INFO(j.dump(1));
  REQUIRE_FALSE(parsed.ok());
  CHECK(absl::IsDataLoss(parsed.status()));
  CHECK_THAT(ckpt::Message(parsed.status()), Catch::Contains("m.json: invalid manifest") && Catch::Contains(why));
}

}  // namespace

TEST_CASE("a version 5 manifest round-trips: increment, extents, chunk sizes, referenced train state") {
  Manifest m = Sample();
  const std::string text = ManifestToJson(m);
  CHECK(json::parse(text)["format_version"] == 5);
  absl::StatusOr<Manifest> parsed = ParseManifest(text, "m.json");
  INFO((parsed.ok() ? "" : ckpt::Message(parsed.status())));
  REQUIRE(parsed.ok());
  CHECK(parsed->format_version == kManifestIncrementFormatVersion);
  REQUIRE(parsed->increment);
  CHECK(parsed->increment->origins == m.increment->origins);
  CHECK(parsed->increment->origin_steps == m.increment->origin_steps);
  CHECK(parsed->increment->own_bytes == m.increment->own_bytes);
  CHECK(parsed->tensors.at("emb").shards[0].extents == m.tensors.at("emb").shards[0].extents);
  CHECK(parsed->tensors.at("emb").shards[0].chunk_bytes == 16);
  CHECK(parsed->tensors.at("emb").shards[1].file == m.shards[1].file);
  CHECK(parsed->shards[0].train_state.at("tok").step == 10);
  CHECK(ManifestToJson(*parsed) == text);
  // Without an increment, the same step is version 1 and names its files the old way.
  CHECK(json::parse(ManifestToJson(Manifest{}))["format_version"] == 1);
}

TEST_CASE("version 5 needs its increment, and only version 5 may carry one") {
  json j = Json(Sample());
  json no_increment = j;
  no_increment.erase("increment");
  RefusedFor(no_increment, "\"manifest\" has no \"increment\"");
  json older = j;
  older["format_version"] = 4;
  RefusedFor(older, "it has an \"increment\", which needs format version 5, not 4");
  json newer = j;
  newer["format_version"] = 6;
  RefusedFor(newer, "format version 6 is newer than this ckptd understands (5)");
  json both = j;
  both["scope"] = json::object();
  both["index"] = json::object();
  RefusedFor(both, "both a \"scope\" and an \"index\"");
}

TEST_CASE("version 5 file names are tagged and name their rank; nothing else is opened") {
  for (const char* name : {"rank-00000.safetensors", "rank-00000.5000.safetensors", "rank-00000.000000000000500.safetensors",
                           "rank-00000.000000000000500G.safetensors", "rank-00001.0000000000005001.safetensors",
                           "../rank-00000.0000000000005000.safetensors", "rank-00000.000000000000ABCD.safetensors"}) {
    INFO(name);
    json j = Json(Sample());
    j["shards"][0]["file"] = name;
    RefusedFor(j, "rank 0's shard file is not named rank-00000.<16 hex digits>.safetensors");
    json origin = Json(Sample());
    origin["increment"]["origins"][0]["file"] = name;
    RefusedFor(origin, "origin of step 10 rank 0: file");
  }
  CHECK(IsTaggedShardFileName("rank-00000.0000000000005000.safetensors", 0));
  CHECK(IsTaggedShardFileName("rank-1048575.18f3a9c2d4e5b6a7.safetensors", 1048575));
}

TEST_CASE("extents cover every chunk of their piece once, in order, in files the step lists") {
  auto with_extents = [](const json& extents) {
    json j = Json(Sample());
    j["tensors"]["emb"]["shards"][0]["extents"] = extents;
    return j;
  };
  json gap = json::array({{{"chunks", {0, 2}}, {"step", 10}, {"at", 4096}}, {{"chunks", {3, 4}}, {"at", 0}}});
  RefusedFor(with_extents(gap), "extent of chunks [3, 4) does not continue from chunk 2");
  json overlap = json::array({{{"chunks", {0, 3}}, {"at", 0}}, {{"chunks", {2, 4}}, {"at", 0}}});
  RefusedFor(with_extents(overlap), "extent of chunks [2, 4) does not continue from chunk 3");
  json short_cover = json::array({{{"chunks", {0, 3}}, {"at", 0}}});
  RefusedFor(with_extents(short_cover), "its extents cover 3 of its 4 chunks");
  json beyond = json::array({{{"chunks", {0, 5}}, {"at", 0}}});
  RefusedFor(with_extents(beyond), "inside the piece's 4 chunks");
  json empty = json::array({{{"chunks", {0, 0}}, {"at", 0}}, {{"chunks", {0, 4}}, {"at", 0}}});
  RefusedFor(with_extents(empty), "extent of chunks [0, 0)");
  json unlisted = json::array({{{"chunks", {0, 4}}, {"step", 15}, {"at", 0}}});
  RefusedFor(with_extents(unlisted), "is in step 15, which the increment's origins do not list for rank 0");
  json itself = json::array({{{"chunks", {0, 4}}, {"step", 30}, {"at", 0}}});
  RefusedFor(with_extents(itself), "is in step 30");
  // Rank 1 references nothing: no origin of its rank.
  json j = Json(Sample());
  j["tensors"]["emb"]["shards"][1].erase("file");
  j["tensors"]["emb"]["shards"][1].erase("data_offsets");
  j["tensors"]["emb"]["shards"][1]["extents"] = json::array({{{"chunks", {0, 4}}, {"step", 10}, {"at", 4096}}});
  RefusedFor(j, "which the increment's origins do not list for rank 1");
  json mixed = Json(Sample());
  mixed["tensors"]["emb"]["shards"][0]["data_offsets"] = {0, 64};
  RefusedFor(mixed, "has \"extents\", which need format version 5 and no \"file\" or \"data_offsets\"");
}

TEST_CASE("chunk sizes fit their dtype and bound a piece's chunks; chunk checksums match them") {
  json j = Json(Sample());
  json zero = j;
  zero["tensors"]["emb"]["shards"][1]["chunk_bytes"] = 0;
  RefusedFor(zero, "chunk_bytes 0 is not a positive multiple of F32's 4 bytes");
  json odd = j;
  odd["tensors"]["emb"]["shards"][1]["chunk_bytes"] = 6;
  RefusedFor(odd, "chunk_bytes 6 is not a positive multiple");
  json missing = j;
  missing["tensors"]["emb"]["shards"][1].erase("chunk_bytes");
  RefusedFor(missing, "has no \"chunk_bytes\"");
  json few = j;
  few["tensors"]["emb"]["shards"][1]["chunk_checksums"] = {kChunk, kChunk};
  RefusedFor(few, "rank 1 lists 2 chunk checksums for an entry of 4 chunks");
  json none = j;
  none["tensors"]["emb"]["shards"][1].erase("chunk_checksums");
  RefusedFor(none, "rank 1 lists 0 chunk checksums for an entry of 4 chunks");
  Manifest big = Sample();
  big.tensors["emb"].global_shape = {2 * 1048577, 4};
  big.tensors["emb"].shards[1].offset = {1048577, 0};
  big.tensors["emb"].shards[1].shape = {1048577, 4};
  big.tensors["emb"].shards.erase(big.tensors["emb"].shards.begin());
  RefusedFor(Json(big), "1048577 chunks of 16 bytes, more than the 1048576 a piece may have");
}

TEST_CASE("origins are listed once each, never the step itself, and origin_steps are theirs") {
  json j = Json(Sample());
  json itself = j;
  itself["increment"]["origins"][1]["step"] = 30;
  RefusedFor(itself, "origin of rank 0 is step 30 itself");
  json twice = j;
  twice["increment"]["origins"][1]["step"] = 10;
  RefusedFor(twice, "origins are not in strictly ascending (step, rank) order");
  json steps = j;
  steps["increment"]["origin_steps"] = json::array({{{"step", 10}, {"run", 5}}});
  RefusedFor(steps, "origin_steps are not the steps its origins name");
  json unsorted = j;
  unsorted["increment"]["origin_steps"] = json::array({{{"step", 20}, {"run", 5}}, {{"step", 10}, {"run", 5}}});
  RefusedFor(unsorted, "origin_steps are not in strictly ascending (step, run) order");
  json state = j;
  state["shards"][0]["train_state"]["tok"]["step"] = 15;
  RefusedFor(state, "train state tok of rank 0 is in step 15, which the increment's origins do not list");
  json outside = j;
  outside["shards"][0]["train_state"]["tok"]["data_offsets"] = {8000, 9001};
  RefusedFor(outside, "train state tok of rank 0: byte range outside the file");
  json typed = j;
  typed["increment"]["own_bytes"] = "many";
  RefusedFor(typed, "\"increment.own_bytes\" is not an integer in range");
}

TEST_CASE("a version 5 step scoped to a node, and indexed, joins back with its origins") {
  Manifest whole = Sample();
  // Node 0 holds rank 0, node 1 rank 1: each part as a node writes it (scoped, version 5).
  std::map<std::string, std::string> files;
  Manifest index;
  for (uint32_t node = 0; node < 2; ++node) {
    Manifest part = whole;
    RemoveRanks(part, [&](uint32_t rank) { return rank != node; });
    part.scope = StepScope{node, 2, whole.StepBytes(), 1, "xxh3:0000000000000009"};
    part.nodes = {{node, {node}}};
    part.increment->own_bytes = whole.increment->own_bytes;  // the whole step's, as scope's
    part.increment->referenced_bytes = whole.increment->referenced_bytes;
    const std::string text = ManifestToJson(part);
    CHECK(json::parse(text)["format_version"] == 5);
    absl::StatusOr<Manifest> parsed = ParseManifest(text, "part");
    INFO((parsed.ok() ? "" : ckpt::Message(parsed.status())));
    REQUIRE(parsed.ok());
    CHECK(parsed->increment->origins.size() == (node == 0 ? 2 : 0));
    if (node == 0) index = IndexHeader(part);
    AddToIndex(index, part, text);
    files[ManifestPartFileName(node)] = text;
  }
  index.increment->origin_steps = whole.increment->origin_steps;
  const std::string index_text = ManifestToJson(index);
  CHECK(json::parse(index_text)["format_version"] == 5);
  absl::StatusOr<Manifest> parsed_index = ParseManifest(index_text, "index");
  INFO((parsed_index.ok() ? "" : ckpt::Message(parsed_index.status())));
  REQUIRE(parsed_index.ok());
  CHECK(parsed_index->increment->origins.empty());
  absl::StatusOr<Manifest> joined = JoinIndexedManifest(
      *parsed_index, [&](const std::string& file, size_t) -> absl::StatusOr<std::string> { return files.at(file); },
      kMaxManifestBytes, "index");
  INFO((joined.ok() ? "" : ckpt::Message(joined.status())));
  REQUIRE(joined.ok());
  CHECK(joined->increment->origins == whole.increment->origins);
  CHECK(joined->increment->own_bytes == whole.increment->own_bytes);
  CHECK(joined->tensors.at("emb").shards[0].extents == whole.tensors.at("emb").shards[0].extents);
  // An index that names other origin steps than its parts do is not theirs.
  Manifest wrong = *parsed_index;
  wrong.increment->origin_steps.pop_back();
  absl::StatusOr<Manifest> refused = JoinIndexedManifest(
      wrong, [&](const std::string& file, size_t) -> absl::StatusOr<std::string> { return files.at(file); },
      kMaxManifestBytes, "index");
  CHECK_FALSE(refused.ok());
}
