#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "format/manifest.h"

using namespace ckpt::format;

namespace {

Manifest Sample() {
  Manifest m;
  m.job = "llm";
  m.step = 1200;
  m.unix_time = 1.5e9;
  m.wall_time = "2026-11-22T06:00:00Z";
  m.world_size = 2;
  m.ckptd_version = "0.1.0";
  m.metadata = {{"loss", "1.5"}};
  for (uint32_t r = 0; r < 2; ++r) {
    ManifestShard s;
    s.rank = r;
    s.file = ckpt::format::ShardFileName(r);
    s.bytes = 100 + r;
    s.train_state["rng"] = {16, 24, "xxh3:00000000000000ab"};
    m.shards.push_back(s);
    m.tensors["w"].dtype = "F32";
    m.tensors["w"].global_shape = {4, 2};
    m.tensors["w"].shards.push_back({r, s.file, 0, 16, {2 * r, 0}, {2, 2}, "xxh3:0000000000000001", {}, {}});
  }
  return m;
}

}  // namespace

TEST_CASE("manifest round-trips through JSON") {
  Manifest m = Sample();
  auto parsed = ParseManifest(ManifestToJson(m), "test");
  REQUIRE(parsed.ok());
  CHECK(parsed->job == "llm");
  CHECK(parsed->step == 1200);
  CHECK(parsed->world_size == 2);
  CHECK(parsed->metadata.at("loss") == "1.5");
  CHECK(parsed->tensors.at("w").shards[1].offset == std::vector<int64_t>{2, 0});
  CHECK(parsed->shards[1].train_state.at("rng").checksum == "xxh3:00000000000000ab");
  CHECK(parsed->total_bytes() == 201);
}

TEST_CASE("manifest JSON carries the documented fields") {
  auto j = nlohmann::json::parse(ManifestToJson(Sample()));
  for (const char* key : {"format", "format_version", "job", "step", "wall_time", "world_size",
                          "ckptd_version", "metadata", "shards", "tensors"}) {
    CHECK(j.contains(key));
  }
  CHECK(j["tensors"]["w"]["shards"][0].contains("checksum"));
}

TEST_CASE("damaged manifests are refused with the source named") {
  auto j = nlohmann::json::parse(ManifestToJson(Sample()));
  auto refuse = [](const nlohmann::json& doc) {
    auto parsed = ParseManifest(doc.dump(), "/ckpt/llm/step-00001200/manifest.json");
    REQUIRE_FALSE(parsed.ok());
    CHECK(ckpt::Message(parsed.status()).find("manifest.json") != std::string::npos);
  };
  auto newer = j;
  newer["format_version"] = 99;
  refuse(newer);
  auto missing = j;
  missing.erase("world_size");
  refuse(missing);
  auto gap = j;
  gap["shards"][1]["rank"] = 5;
  refuse(gap);
  auto escape = j;
  escape["shards"][0]["file"] = "../../etc/passwd";
  refuse(escape);
  CHECK_FALSE(ParseManifest("{", "x").ok());
  CHECK_FALSE(ParseManifest("[]", "x").ok());
}

TEST_CASE("a manifest cannot point a reader outside its files or its tensors") {
  auto j = nlohmann::json::parse(ManifestToJson(Sample()));
  auto refused_for = [](const nlohmann::json& doc, const std::string& why,
                        ManifestScope scope = ManifestScope::kWhole) {
    auto parsed = ParseManifest(doc.dump(), "m.json", scope);
    REQUIRE_FALSE(parsed.ok());
    CHECK_THAT(ckpt::Message(parsed.status()), Catch::Contains(why));
  };
  auto job = j;
  job["job"] = "../other";
  refused_for(job, "job");
  auto other_file = j;
  other_file["shards"][0]["file"] = ShardFileName(1);  // rank 0 claiming rank 1's file
  refused_for(other_file, "rank 0's shard file");
  auto piece_file = j;
  piece_file["tensors"]["w"]["shards"][0]["file"] = ShardFileName(1);
  refused_for(piece_file, "tensor w");
  auto beyond = j;
  beyond["tensors"]["w"]["shards"][1]["data_offsets"] = {0, 4096};
  refused_for(beyond, "not inside rank 1's file");
  auto outside = j;
  outside["tensors"]["w"]["shards"][1]["offset"] = {3, 0};
  refused_for(outside, "outside the global shape");
  auto dims = j;
  dims["tensors"]["w"]["shards"][1]["shape"] = {2};
  refused_for(dims, "placement");
  auto state = j;
  state["shards"][0]["train_state"]["rng"]["data_offsets"] = {16, 1 << 20};
  refused_for(state, "train state rng");
  // A node's part may not describe pieces of ranks it does not hold.
  auto part = j;
  part["shards"].erase(1);
  refused_for(part, "that the shards list does not", ManifestScope::kPart);
  auto name = j;
  name["tensors"]["__metadata__"] = name["tensors"]["w"];
  refused_for(name, "__");
}

namespace {

ckpt::format::Manifest Part(uint32_t world, std::vector<uint32_t> ranks, std::string dtype = "F32") {
  ckpt::format::Manifest m;
  m.job = "llm";
  m.step = 40;
  m.world_size = world;
  m.ckptd_version = "test";
  for (uint32_t r : ranks) {
    ckpt::format::ManifestShard s;
    s.rank = r;
    s.file = ckpt::format::ShardFileName(r);
    s.bytes = 64;
    m.shards.push_back(s);
    m.tensors["w"].dtype = dtype;
    m.tensors["w"].global_shape = {16 * static_cast<int64_t>(world)};
    m.tensors["w"].shards.push_back({r, s.file, 0, 64, {16 * static_cast<int64_t>(r)}, {16}, "c", {}, {}});
  }
  return m;
}

}  // namespace

TEST_CASE("nodes' manifest parts merge into the whole step, with who holds what") {
  using ckpt::format::MergeManifestParts;
  auto merged = MergeManifestParts({{2, Part(4, {3})}, {0, Part(4, {0, 1})}, {1, Part(4, {2})}});
  REQUIRE(merged.ok());
  CHECK(merged->shards.size() == 4);
  CHECK(merged->tensors.at("w").shards.size() == 4);
  CHECK(merged->tensors.at("w").shards[3].rank == 3);
  REQUIRE(merged->nodes.size() == 3);
  CHECK(merged->nodes[0].ranks == std::vector<uint32_t>{0, 1});
  CHECK(merged->NodeOf(3) == 2u);
  // The merged manifest is a whole one: it round-trips, nodes included.
  auto parsed = ckpt::format::ParseManifest(ckpt::format::ManifestToJson(*merged), "merged");
  REQUIRE(parsed.ok());
  CHECK(parsed->nodes.size() == 3);
  // A part parses only as a part.
  std::string part = ckpt::format::ManifestToJson(Part(4, {1, 3}));
  CHECK_FALSE(ckpt::format::ParseManifest(part, "p").ok());
  CHECK(ckpt::format::ParseManifest(part, "p", ckpt::format::ManifestScope::kPart).ok());
}

TEST_CASE("parts whose pieces have chunk checksums merge into a whole manifest that reads back") {
  // Each rank's piece is 3 chunks long (more than checksum_chunk_bytes): the merged
  // manifest must say the chunk size, or its chunk checksums would not parse.
  auto chunked = [](std::vector<uint32_t> ranks) {
    ckpt::format::Manifest m = Part(2, ranks);
    m.checksum_chunk_bytes = 32;
    for (auto& s : m.shards) s.bytes = 96;
    for (auto& piece : m.tensors.at("w").shards) {
      piece.end = 96;
      piece.shape = {24};
      piece.offset = {24 * static_cast<int64_t>(piece.rank)};
      piece.chunk_checksums = {"a", "b", "c"};
    }
    m.tensors.at("w").global_shape = {48};
    return m;
  };
  auto merged = ckpt::format::MergeManifestParts({{0, chunked({0})}, {1, chunked({1})}});
  REQUIRE(merged.ok());
  CHECK(merged->checksum_chunk_bytes == 32);
  auto parsed = ckpt::format::ParseManifest(ckpt::format::ManifestToJson(*merged), "merged");
  INFO(parsed.status());
  REQUIRE(parsed.ok());
  CHECK(parsed->tensors.at("w").shards[1].chunk_checksums.size() == 3);
  // Nodes that chunk differently do not make one manifest.
  auto other = chunked({1});
  other.checksum_chunk_bytes = 48;
  auto refused = ckpt::format::MergeManifestParts({{0, chunked({0})}, {1, other}});
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(ckpt::Message(refused.status()), Catch::Contains("chunks of 48 bytes"));
}

TEST_CASE("parts that disagree or leave a gap are refused, naming the problem") {
  using ckpt::format::MergeManifestParts;
  auto missing = MergeManifestParts({{0, Part(3, {0})}, {1, Part(3, {2})}});
  REQUIRE_FALSE(missing.ok());
  CHECK(ckpt::Message(missing.status()).find("missing ranks 1") != std::string::npos);
  auto twice = MergeManifestParts({{0, Part(2, {0, 1})}, {1, Part(2, {1})}});
  CHECK(ckpt::Message(twice.status()).find("rank 1 of step 40 was prepared twice") != std::string::npos);
  auto dtype = MergeManifestParts({{0, Part(2, {0})}, {1, Part(2, {1}, "BF16")}});
  CHECK(ckpt::Message(dtype.status()).find("tensor w") != std::string::npos);
  auto world = MergeManifestParts({{0, Part(2, {0})}, {1, Part(3, {1})}});
  CHECK(ckpt::Message(world.status()).find("world size") != std::string::npos);
}

TEST_CASE("numbers of the wrong type or range are refused, not cast") {
  auto j = nlohmann::json::parse(ManifestToJson(Sample()));
  for (auto [field, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"format_version", 7.7e40}, {"step", -1}, {"world_size", 1e300}, {"world_size", 5000000000ull},
           {"unix_time", "soon"}}) {
    auto doc = j;
    doc[field] = value;
    auto parsed = ParseManifest(doc.dump(), "m.json");
    INFO(field << " = " << value.dump());
    CHECK_FALSE(parsed.ok());
  }
  auto shape = j;
  shape["tensors"]["w"]["global_shape"] = {4.5, 2};
  CHECK_FALSE(ParseManifest(shape.dump(), "m.json").ok());
}

TEST_CASE("a manifest carries its own checksum: an edited one is refused") {
  std::string text = ManifestToJson(Sample());
  CHECK(text.find("\"manifest_checksum\": \"xxh3:") != std::string::npos);
  REQUIRE(ParseManifest(text, "m.json").ok());
  // A value changed in place, everything else intact: still valid JSON and a valid manifest.
  std::string edited = text;
  auto at = edited.find("\"1.5\"");
  REQUIRE(at != std::string::npos);
  edited.replace(at, 5, "\"9.9\"");
  auto parsed = ParseManifest(edited, "m.json");
  REQUIRE_FALSE(parsed.ok());
  CHECK_THAT(ckpt::Message(parsed.status()), Catch::Contains("checksum does not match"));
  // Manifests from before the checksum (no field) are still read.
  auto j = nlohmann::json::parse(text);
  j.erase("manifest_checksum");
  CHECK(ParseManifest(j.dump(1), "old.json").ok());
}

TEST_CASE("chunk checksums round-trip, and a list that does not fit its entry is refused") {
  Manifest m = Sample();
  m.checksum_chunk_bytes = 8;  // entries of 16 bytes: two chunks each
  for (auto& s : m.tensors["w"].shards) s.chunk_checksums = {"xxh3:0000000000000002", "xxh3:0000000000000003"};
  auto parsed = ParseManifest(ManifestToJson(m), "test");
  REQUIRE(parsed.ok());
  CHECK(parsed->checksum_chunk_bytes == 8);
  CHECK(parsed->tensors.at("w").shards[1].chunk_checksums ==
        std::vector<std::string>{"xxh3:0000000000000002", "xxh3:0000000000000003"});
  // Older manifests have none: still read (whole-entry checksums only).
  CHECK(ParseManifest(ManifestToJson(Sample()), "old")->checksum_chunk_bytes == 0);

  auto j = nlohmann::json::parse(ManifestToJson(m));
  j.erase("manifest_checksum");
  auto short_list = j;
  short_list["tensors"]["w"]["shards"][0]["chunk_checksums"] = {"xxh3:0000000000000002"};
  auto refused = ParseManifest(short_list.dump(), "m.json");
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(ckpt::Message(refused.status()),
             Catch::Contains("tensor w: rank 0 lists 1 chunk checksums for an entry of 2 chunks"));
  auto zero = j;
  zero["checksum_chunk_bytes"] = 0;
  CHECK_FALSE(ParseManifest(zero.dump(), "m.json").ok());
}

TEST_CASE("flat shards round-trip; ranges that do not fit, and entries of the wrong size, are refused") {
  Manifest m = Sample();
  auto& shards = m.tensors["w"].shards;  // the [4, 2] tensor as FSDP flat shards: 3 and 5 elements
  shards[0] = {0, ShardFileName(0), 0, 12, {}, {3}, "xxh3:0000000000000001", {}, {{0, 3}}};
  shards[1] = {1, ShardFileName(1), 0, 20, {}, {5}, "xxh3:0000000000000001", {}, {{3, 5}, {5, 8}}};
  auto parsed = ParseManifest(ManifestToJson(m), "test");
  REQUIRE(parsed.ok());
  CHECK(parsed->tensors.at("w").shards[1].flat == std::vector<ElementRange>{{3, 5}, {5, 8}});
  CHECK(parsed->tensors.at("w").shards[1].offset.empty());
  CHECK(nlohmann::json::parse(ManifestToJson(m))["tensors"]["w"]["shards"][0]["flat"] ==
        nlohmann::json::parse("[[0, 3]]"));

  auto j = nlohmann::json::parse(ManifestToJson(m));
  j.erase("manifest_checksum");
  auto refused_for = [](const nlohmann::json& doc, const std::string& why) {
    auto refused = ParseManifest(doc.dump(), "m.json");
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(ckpt::Message(refused.status()), Catch::Contains(why));
  };
  auto past_end = j;
  past_end["tensors"]["w"]["shards"][1]["flat"] = {{3, 5}, {5, 9}};
  refused_for(past_end, "tensor w: rank 1's piece has flat element range [5, 9)");
  auto backwards = j;
  backwards["tensors"]["w"]["shards"][1]["flat"] = {{5, 8}, {3, 5}};
  refused_for(backwards, "out of order");
  auto not_total = j;
  not_total["tensors"]["w"]["shards"][1]["shape"] = {4};
  refused_for(not_total, "holding 5 elements but local shape [4]");
  // An entry whose bytes are not its shape's: the reader would run off it.
  auto wrong_size = nlohmann::json::parse(ManifestToJson(Sample()));
  wrong_size.erase("manifest_checksum");
  wrong_size["tensors"]["w"]["shards"][0]["data_offsets"] = {0, 12};
  refused_for(wrong_size, "tensor w: rank 0's entry holds 12 bytes; F32 [2, 2] is 16");
}
