// Indexed steps (format version 4): a step too large for one manifest is published as one
// node-scoped manifest per node and an index naming each by its size and checksum; readers
// join them, and refuse any part that is not the one the index names.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "format/checkpoint_store.h"
#include "format/indexed_manifest.h"
#include "format/manifest.h"
#include "tests/fakes/four_rank_step.h"
#include "tests/fakes/increment_chain.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt::format;

namespace {

// FourRankStep(), each rank also holding its quarter of "b" [4] as a flat shard, with
// metadata of its own and chunk checksums recorded.
Manifest Whole() {
  Manifest m = ckpt::testing::FourRankStep();
  m.checksum_chunk_bytes = kChecksumChunkBytes;
  for (uint32_t r = 0; r < 4; ++r) {
    m.shards[r].bytes = 100 + r;
    m.shards[r].metadata = {{"rank", std::to_string(r)}};
    m.tensors["b"].dtype = "F32";
    m.tensors["b"].global_shape = {4};
    m.tensors["b"].shards.push_back({r, ShardFileName(r), 8, 12, {}, {1}, "xxh3:0000000000000002", {},
                                     {{int64_t{r}, int64_t{r} + 1}}});
  }
  return m;
}

constexpr char kDigest[] = "xxh3:00000000000000aa";

// `node`'s scoped manifest of Whole(), as the coordinator writes it.
Manifest PartOf(const Manifest& whole, uint32_t node, const std::string& digest = kDigest) {
  Manifest part = whole;
  const ManifestNode& mine = whole.nodes.at(node);
  RemoveRanks(part, [&](uint32_t r) { return std::find(mine.ranks.begin(), mine.ranks.end(), r) == mine.ranks.end(); });
  part.nodes = {mine};
  part.scope = StepScope{node, 2, whole.total_bytes(), static_cast<uint32_t>(whole.tensors.size()), digest};
  return part;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

struct Fixture {
  ckpt::testing::TempDir dir;
  CheckpointStore store{ckpt::MakePosixFilesystem(), dir.path()};
  std::string step_dir = dir / "llm/step-00001200";

  // Publishes Whole() as an index and its two parts; returns the index.
  Manifest Publish(const Manifest& whole = Whole()) {
    REQUIRE(store.BeginStep("llm", 1200).ok());
    Manifest index = IndexHeader(PartOf(whole, 0));
    for (uint32_t node : {0u, 1u}) REQUIRE(store.WriteManifestPart(PartOf(whole, node), index).ok());
    REQUIRE(store.Commit(index).ok());
    return index;
  }

  std::string LoadError() {
    auto loaded = store.LoadManifest("llm", 1200);
    REQUIRE_FALSE(loaded.ok());
    return ckpt::Message(loaded.status());
  }
};

}  // namespace

TEST_CASE("an indexed step reads back as the whole step it was cut from") {
  Fixture f;
  const Manifest whole = Whole();
  const Manifest index = f.Publish(whole);
  const std::string text = ReadFile(f.step_dir + "/manifest.json");
  auto doc = nlohmann::json::parse(text);
  CHECK(doc["format_version"] == kManifestIndexFormatVersion);
  CHECK(doc["shards"].empty());
  CHECK(doc["tensors"].empty());
  CHECK(doc["index"]["parts"].size() == 2);
  CHECK(doc["index"]["parts"][1]["file"] == "manifest-node-00001.json");
  CHECK(doc["index"]["parts"][1]["checksum"] ==
        ManifestDigest(ReadFile(f.step_dir + "/manifest-node-00001.json")));

  auto joined = f.store.LoadManifest("llm", 1200);
  REQUIRE(joined.ok());
  CHECK_FALSE(joined->index.has_value());
  // Byte for byte the manifest the step would have had whole.
  CHECK(ManifestToJson(*joined) == ManifestToJson(whole));
  CHECK(joined->Shard(3)->metadata.at("rank") == "3");
  CHECK(joined->NodeOf(3) == 0u);

  // Listing reads the index alone, and shows the whole step's figures.
  auto only = f.store.LoadManifest("llm", 1200, CheckpointStore::Depth::kIndexOnly);
  REQUIRE(only.ok());
  REQUIRE(only->index.has_value());
  CHECK(only->tensors.empty());
  CHECK(only->StepBytes() == whole.total_bytes());
  CHECK(only->StepTensors() == 2);
  auto listed = ListCheckpoints(f.store, "llm");
  REQUIRE(listed.ok());
  REQUIRE(listed->size() == 1);
  CHECK(listed->at(0).bytes == whole.total_bytes());
  CHECK(listed->at(0).tensors == 2);
  CHECK(listed->at(0).error.empty());
  // The index round-trips.
  auto reparsed = ParseManifest(ManifestToJson(index), "index");
  REQUIRE(reparsed.ok());
  CHECK(ManifestToJson(*reparsed) == text);
}

TEST_CASE("a reader refuses a part that is not the one its index names") {
  Fixture f;
  f.Publish();
  const std::string part_path = f.step_dir + "/manifest-node-00001.json";
  const std::string original = ReadFile(part_path);

  SECTION("missing") {
    std::filesystem::remove(part_path);
    CHECK_THAT(f.LoadError(), Catch::Contains("node 1's part") && Catch::Contains("missing"));
  }
  SECTION("edited: another checksum of rank 1's piece") {
    std::string edited = original;
    edited.replace(edited.find("xxh3:0000000000000001"), 21, "xxh3:00000000000000ff");
    WriteFile(part_path, edited);
    CHECK_THAT(f.LoadError(), Catch::Contains("not the part the index names"));
  }
  SECTION("a part of another commit of the step, with the index made to name it") {
    const std::string other = ManifestToJson(PartOf(Whole(), 1, "xxh3:00000000000000bb"));
    WriteFile(part_path, other);
    std::string index = ReadFile(f.step_dir + "/manifest.json");
    auto doc = nlohmann::json::parse(index);
    doc["index"]["parts"][1]["checksum"] = ManifestDigest(other);
    doc["index"]["parts"][1]["bytes"] = other.size();
    doc.erase("manifest_checksum");
    WriteFile(f.step_dir + "/manifest.json", doc.dump(1));
    CHECK_THAT(f.LoadError(), Catch::Contains("another commit of the step"));
  }
  SECTION("node 0's part in node 1's place") {
    const std::string zero = ReadFile(f.step_dir + "/manifest-node-00000.json");
    WriteFile(part_path, zero);
    auto doc = nlohmann::json::parse(ReadFile(f.step_dir + "/manifest.json"));
    doc["index"]["parts"][1]["checksum"] = ManifestDigest(zero);
    doc["index"]["parts"][1]["bytes"] = zero.size();
    doc.erase("manifest_checksum");
    WriteFile(f.step_dir + "/manifest.json", doc.dump(1));
    CHECK_THAT(f.LoadError(), Catch::Contains("it is node 0's part"));
  }
}

TEST_CASE("an index that does not hold together is refused, naming why") {
  Manifest index = IndexHeader(PartOf(Whole(), 0));
  AddToIndex(index, PartOf(Whole(), 0), "part zero");
  AddToIndex(index, PartOf(Whole(), 1), "part one");
  const auto doc = nlohmann::json::parse(ManifestToJson(index));
  REQUIRE(ParseManifest(doc.dump(), "index").ok());
  auto refused = [&](nlohmann::json edited, const std::string& why) {
    edited.erase("manifest_checksum");
    auto parsed = ParseManifest(edited.dump(), "/ckpt/llm/step-00001200/manifest.json");
    REQUIRE_FALSE(parsed.ok());
    CHECK_THAT(ckpt::Message(parsed.status()), Catch::Contains(why));
  };
  auto older = doc;
  older["format_version"] = 2;
  refused(older, "needs format version 4, not 2");
  auto unindexed = doc;
  unindexed.erase("index");
  refused(unindexed, "format version 4 is an index, but it has no \"index\"");
  auto with_shards = doc;
  with_shards["shards"] = nlohmann::json::parse(ManifestToJson(Whole()))["shards"];
  refused(with_shards, "lists shards or tensors");
  auto renamed = doc;
  renamed["index"]["parts"][1]["file"] = "rank-00001.safetensors";
  refused(renamed, "not node 1's, manifest-node-00001.json");
  auto twice = doc;
  twice["nodes"][1]["ranks"] = {1, 3};
  refused(twice, "rank 3 is on two nodes");
  auto short_of_ranks = doc;
  short_of_ranks["nodes"][1]["ranks"] = {1};
  refused(short_of_ranks, "hold 3 of the 4 ranks");
  auto fewer_parts = doc;
  fewer_parts["index"]["parts"].erase(1);
  refused(fewer_parts, "lists 2 nodes but 1 parts");
  auto bad_checksum = doc;
  bad_checksum["index"]["parts"][0]["checksum"] = "md5:0";
  refused(bad_checksum, "part checksum \"md5:0\"");
  auto both = doc;
  both["scope"] = nlohmann::json::parse(ManifestToJson(PartOf(Whole(), 1)))["scope"];
  refused(both, "both a \"scope\" and an \"index\"");
}

TEST_CASE("a reader of one rank reads the part of the node that holds it, and no other") {
  Fixture f;
  f.Publish();
  bool from_index = false;
  auto part = f.store.LoadManifestForRank("llm", 1200, 2, &from_index);
  REQUIRE(part.ok());
  CHECK(from_index);
  REQUIRE(part->scope.has_value());
  CHECK(part->scope->node == 1);
  CHECK(part->shards.size() == 2);
  CHECK(part->Shard(2) != nullptr);
  CHECK(part->StepTensors() == 2);
  // Node 0's part is not read: it may be gone, and rank 2's reader does not notice.
  std::filesystem::remove(f.step_dir + "/manifest-node-00000.json");
  CHECK(f.store.LoadManifestForRank("llm", 1200, 1, &from_index).ok());
  // But rank 0's reader does, naming the part.
  auto lost = f.store.LoadManifestForRank("llm", 1200, 0, &from_index);
  REQUIRE_FALSE(lost.ok());
  CHECK_THAT(ckpt::Message(lost.status()), Catch::Contains("manifest-node-00000.json") && Catch::Contains("missing"));
}

TEST_CASE("a reader of one rank of a step that is not indexed gets its manifest") {
  ckpt::testing::TempDir dir;
  CheckpointStore store{ckpt::MakePosixFilesystem(), dir.path()};
  Manifest whole = Whole();
  whole.nodes.clear();
  REQUIRE(store.BeginStep("llm", 1200).ok());
  REQUIRE(store.Commit(whole).ok());
  bool from_index = true;
  auto loaded = store.LoadManifestForRank("llm", 1200, 3, &from_index);
  REQUIRE(loaded.ok());
  CHECK_FALSE(from_index);
  CHECK(loaded->shards.size() == 4);
}

TEST_CASE("an incremental step (version 5) indexed reads back whole; its index holds every part's origin steps") {
  ckpt::testing::TempDir dir;
  constexpr int64_t kRows = 16, kCols = 8;
  ckpt::testing::IncrementChain chain(dir.path(), "llm", 4, {{"emb", {"F32", {4 * kRows, kCols}}}},
                                      kCols * 4 * 4);  // 4 chunks a piece
  std::vector<std::vector<float>> emb(4, std::vector<float>(kRows * kCols, 1.f));
  Manifest whole;
  for (uint64_t step : {10u, 20u, 30u}) {
    // Rank 0 changes a chunk at 20 and another at 30: its step 30 references steps 10 and
    // 20, node 1's ranks (2 and 3) only step 10.
    if (step == 20) emb[0][0] = 2.f;
    if (step == 30) emb[0][kRows * kCols - 1] = 3.f;
    ckpt::testing::IncrementChain::Step s;
    for (uint32_t r = 0; r < 4; ++r) {
      s.pieces["emb"].push_back(std::string(reinterpret_cast<const char*>(emb[r].data()), emb[r].size() * 4));
      s.train_state.push_back({{"rng", "rng of step " + std::to_string(step)}});
    }
    whole = chain.Write(step, 0x18f3a9c2d4e5b600, s);
  }
  whole.nodes = {{0, {0, 1}}, {1, {2, 3}}};
  REQUIRE(whole.increment->origin_steps.size() == 2);
  REQUIRE(PartOf(whole, 1).increment->origin_steps.size() == 1);
  // Published again as an index and its parts, as a coordinator on a shared root does.
  CheckpointStore store{ckpt::MakePosixFilesystem(), dir.path()};
  const std::string step_dir = dir / "llm/step-00000030";
  std::filesystem::remove(step_dir + "/manifest.json");
  std::filesystem::rename(step_dir, step_dir + ".tmp");
  Manifest index = IndexHeader(PartOf(whole, 0));
  for (uint32_t node : {0u, 1u}) REQUIRE(store.WriteManifestPart(PartOf(whole, node), index).ok());
  REQUIRE(store.Commit(index).ok());
  CHECK(index.increment->origin_steps == whole.increment->origin_steps);
  CHECK(index.increment->origins.empty());  // the parts list them
  CHECK(index.increment->own_bytes == whole.increment->own_bytes);
  auto only = store.LoadManifest("llm", 30, CheckpointStore::Depth::kIndexOnly);
  REQUIRE(only.ok());
  CHECK(only->increment->origin_steps == whole.increment->origin_steps);
  auto joined = store.LoadManifest("llm", 30);
  REQUIRE(joined.ok());
  CHECK(ManifestToJson(*joined) == ManifestToJson(whole));
}
