#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "daemon/persist/manifest.h"

using namespace ckpt::persist;

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
    s.file = "rank-0000" + std::to_string(r) + ".safetensors";
    s.bytes = 100 + r;
    s.train_state["rng"] = {16, 24, "xxh3:00000000000000ab"};
    m.shards.push_back(s);
    m.tensors["w"].dtype = "F32";
    m.tensors["w"].global_shape = {4, 2};
    m.tensors["w"].shards.push_back({r, s.file, 0, 16, {2 * r, 0}, {2, 2}, "xxh3:0000000000000001"});
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
