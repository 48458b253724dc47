// Node-scoped manifests (format version 3): what one node of a group with node-local disks
// writes of a step, its own ranks and a `scope` for the whole step (docs/format.md).
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "tests/fakes/four_rank_step.h"

using namespace ckpt::format;

namespace {

Manifest Whole() { return ckpt::testing::FourRankStep(); }

// Node 1's manifest of Whole(): ranks 1 and 2.
Manifest NodeOne() {
  Manifest whole = Whole();
  Manifest m = whole;
  std::erase_if(m.shards, [](const ManifestShard& s) { return s.rank != 1 && s.rank != 2; });
  std::erase_if(m.tensors.at("w").shards, [](const TensorShard& s) { return s.rank != 1 && s.rank != 2; });
  m.nodes = {{1, {1, 2}}};
  m.scope = StepScope{1, 2, whole.total_bytes(), 1, ManifestDigest(ManifestToJson(whole))};
  return m;
}

void RefusedFor(const nlohmann::json& doc, const std::string& why) {
  auto parsed = ParseManifest(doc.dump(), "/ckpt/llm/step-00001200/manifest.json");
  REQUIRE_FALSE(parsed.ok());
  CHECK_THAT(ckpt::Message(parsed.status()), Catch::Contains(why));
  CHECK_THAT(ckpt::Message(parsed.status()), Catch::Contains("manifest.json"));
}

}  // namespace

TEST_CASE("a node-scoped manifest round-trips as format version 3 with its scope") {
  const Manifest m = NodeOne();
  const std::string text = ManifestToJson(m);
  CHECK(nlohmann::json::parse(text)["format_version"] == kManifestScopedFormatVersion);
  auto parsed = ParseManifest(text, "test");
  REQUIRE(parsed.ok());
  REQUIRE(parsed->scope.has_value());
  CHECK(parsed->format_version == 3);
  CHECK(parsed->scope->node == 1);
  CHECK(parsed->scope->nodes == 2);
  CHECK(parsed->scope->step_bytes == 100 + 101 + 102 + 103);
  CHECK(parsed->scope->step_tensors == 1);
  CHECK(parsed->scope->digest == m.scope->digest);
  CHECK(parsed->run == 7);
  CHECK(parsed->metadata.at("loss") == "1.5");
  CHECK(parsed->world_size == 4);
  CHECK(parsed->shards.size() == 2);
  // The whole step's figures, though only two ranks are listed.
  CHECK(parsed->total_bytes() == 101 + 102);
  CHECK(parsed->StepBytes() == 406);
  CHECK(parsed->StepTensors() == 1);
  CHECK(parsed->NodeOf(2) == 1u);
}

TEST_CASE("Shard(rank) finds the ranks a manifest lists, whole or scoped") {
  const Manifest whole = Whole();
  for (uint32_t r = 0; r < 4; ++r) {
    REQUIRE(whole.Shard(r) != nullptr);
    CHECK(whole.Shard(r)->rank == r);
  }
  CHECK(whole.Shard(4) == nullptr);
  CHECK(whole.StepBytes() == whole.total_bytes());
  CHECK(whole.StepTensors() == 1);

  auto scoped = ParseManifest(ManifestToJson(NodeOne()), "test");
  REQUIRE(scoped.ok());
  REQUIRE(scoped->Shard(1) != nullptr);
  CHECK(scoped->Shard(1)->file == ShardFileName(1));
  REQUIRE(scoped->Shard(2) != nullptr);
  CHECK(scoped->Shard(2)->bytes == 102);
  CHECK(scoped->Shard(0) == nullptr);
  CHECK(scoped->Shard(3) == nullptr);
  CHECK(scoped->Shard(99) == nullptr);
}

TEST_CASE("manifests without a scope keep their versions: 1 for boxes, 2 for flat shards") {
  CHECK(nlohmann::json::parse(ManifestToJson(Whole()))["format_version"] == 1);
  CHECK_FALSE(nlohmann::json::parse(ManifestToJson(Whole())).contains("scope"));
  Manifest flat = Whole();
  for (TensorShard& s : flat.tensors.at("w").shards) {
    s.offset.clear();
    s.shape = {2};
    s.flat = {{2 * int64_t{s.rank}, 2 * int64_t{s.rank} + 2}};
  }
  CHECK(nlohmann::json::parse(ManifestToJson(flat))["format_version"] == 2);
  auto parsed = ParseManifest(ManifestToJson(flat), "test");
  REQUIRE(parsed.ok());
  CHECK_FALSE(parsed->scope.has_value());
}

TEST_CASE("a node's part before a commit still parses as a part, without a scope") {
  Manifest part = Whole();
  std::erase_if(part.shards, [](const ManifestShard& s) { return s.rank != 1 && s.rank != 2; });
  std::erase_if(part.tensors.at("w").shards, [](const TensorShard& s) { return s.rank != 1 && s.rank != 2; });
  part.nodes.clear();
  const std::string text = ManifestToJson(part);
  CHECK(nlohmann::json::parse(text)["format_version"] == 1);
  auto parsed = ParseManifest(text, "part", ManifestScope::kPart);
  REQUIRE(parsed.ok());
  CHECK_FALSE(parsed->scope.has_value());
  CHECK(parsed->shards.size() == 2);
  // The same text is no committed step: two of its four ranks are missing.
  CHECK_FALSE(ParseManifest(text, "part").ok());
}

TEST_CASE("version 3 without a scope, and a scope in an older version, are refused") {
  auto j = nlohmann::json::parse(ManifestToJson(NodeOne()));
  auto unscoped = j;
  unscoped.erase("scope");
  RefusedFor(unscoped, "no \"scope\"");
  auto old = j;
  old["format_version"] = 1;
  RefusedFor(old, "needs format version 3, not 1");
  old["format_version"] = 2;
  RefusedFor(old, "needs format version 3, not 2");
  auto whole = nlohmann::json::parse(ManifestToJson(Whole()));
  whole["scope"] = j["scope"];
  RefusedFor(whole, "needs format version 3");
  auto indexed = j;
  indexed["format_version"] = 4;
  RefusedFor(indexed, "needs format version 3, not 4");
  auto incremental = j;
  incremental["format_version"] = 5;  // a scoped incremental step, but without its increment
  RefusedFor(incremental, "has no \"increment\"");
  auto newer = j;
  newer["format_version"] = 6;
  RefusedFor(newer, "newer than this ckptd understands (5)");
}

TEST_CASE("a manifest describes at most 1M ranks, so that no reader walks billions of other nodes' ranks") {
  auto j = nlohmann::json::parse(ManifestToJson(NodeOne()));
  j["world_size"] = (1u << 20) + 1;
  RefusedFor(j, "world_size 1048577 is over 1048576");
}

TEST_CASE("a scoped manifest's shards ascend, are not empty, and hold every piece it lists") {
  auto j = nlohmann::json::parse(ManifestToJson(NodeOne()));
  auto swapped = j;
  std::swap(swapped["shards"][0], swapped["shards"][1]);
  RefusedFor(swapped, "not in strictly ascending rank order: rank 1 after rank 2");
  auto twice = j;
  twice["shards"][1] = twice["shards"][0];
  RefusedFor(twice, "rank 1 after rank 1");
  auto outside = j;
  outside["shards"][1]["rank"] = 4;
  outside["shards"][1]["file"] = ShardFileName(4);
  RefusedFor(outside, "shard of rank 4 is outside the world of 4 ranks");
  auto empty = j;
  empty["shards"] = nlohmann::json::array();
  empty["tensors"] = nlohmann::json::object();
  empty.erase("nodes");
  RefusedFor(empty, "lists no shards");
  auto foreign = j;
  foreign["tensors"]["w"]["shards"][0]["rank"] = 3;
  foreign["tensors"]["w"]["shards"][0]["file"] = ShardFileName(3);
  RefusedFor(foreign, "tensor w: a piece of rank 3, which node 1's scoped manifest does not list");
}

TEST_CASE("a scoped manifest's nodes name its own node and exactly its ranks") {
  auto j = nlohmann::json::parse(ManifestToJson(NodeOne()));
  auto other_node = j;
  other_node["nodes"][0]["node"] = 0;
  RefusedFor(other_node, "lists other nodes than node 1 alone");
  auto two = j;
  two["nodes"].push_back({{"node", 0}, {"ranks", {0, 3}}});
  RefusedFor(two, "lists other nodes than node 1 alone");
  auto other_ranks = j;
  other_ranks["nodes"][0]["ranks"] = {1, 3};
  RefusedFor(other_ranks, "\"nodes\" gives node 1 ranks [1, 3], but its shards are ranks [1, 2]");
  // Without `nodes` it is still a node's manifest: the scope names the node.
  auto no_nodes = j;
  no_nodes.erase("nodes");
  no_nodes.erase("manifest_checksum");
  auto parsed = ParseManifest(no_nodes.dump(), "test");
  REQUIRE(parsed.ok());
  CHECK(parsed->scope->node == 1);
}

TEST_CASE("a scope that cannot describe the step it is cut from is refused") {
  auto j = nlohmann::json::parse(ManifestToJson(NodeOne()));
  auto set = [&](const char* field, const nlohmann::json& value) {
    auto doc = j;
    doc["scope"][field] = value;
    return doc;
  };
  RefusedFor(set("nodes", 0), "scope says 0 nodes hold ranks of a step of world size 4");
  RefusedFor(set("nodes", 5), "scope says 5 nodes hold ranks of a step of world size 4");
  RefusedFor(set("nodes", 4), "scope says 4 nodes hold the 4 ranks of the step, but node 1 lists 2");
  RefusedFor(set("step_bytes", 200), "fewer than the 203 of node 1's own shards");
  RefusedFor(set("step_tensors", 0), "scope says the step holds 0 tensors, fewer than the 1");
  RefusedFor(set("digest", "xxh3:ABCDEF0123456789"), "is not \"xxh3:\" and 16 lowercase hex digits");
  RefusedFor(set("digest", "sha1:0123456789abcdef"), "16 lowercase hex digits");
  RefusedFor(set("node", -1), "\"scope.node\" is not an integer in range");
  RefusedFor(set("digest", 5), "\"scope.digest\" is not a string");
  auto missing = j;
  missing["scope"].erase("step_bytes");
  RefusedFor(missing, "\"scope\" has no \"step_bytes\"");
  auto not_object = j;
  not_object["scope"] = 3;
  RefusedFor(not_object, "\"scope\" is not an object");
}

TEST_CASE("a scoped manifest's scope is covered by its checksum") {
  auto j = nlohmann::json::parse(ManifestToJson(NodeOne()));
  j["scope"]["step_bytes"] = 999;
  RefusedFor(j, "checksum does not match");
}

TEST_CASE("ManifestDigest is XXH3 of the text, as \"xxh3:\" and 16 lowercase hex digits") {
  const std::string text = ManifestToJson(Whole());
  const std::string digest = ManifestDigest(text);
  CHECK(digest == ManifestDigest(text));
  CHECK(digest == ChecksumOf(text.data(), text.size()));
  REQUIRE(digest.size() == 5 + 16);
  CHECK(digest.compare(0, 5, "xxh3:") == 0);
  CHECK(digest.find_first_not_of("0123456789abcdef", 5) == std::string::npos);
  CHECK(ManifestDigest(text + " ") != digest);
  // XXH3-64 of nothing, a published value: the digest does not drift between builds.
  CHECK(ManifestDigest("") == "xxh3:2d06800538d394c2");
}
