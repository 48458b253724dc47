// format::JsonText must write what nlohmann::json::dump() writes for the same document, byte
// for byte: a manifest's checksum is over nlohmann's text. Checked against nlohmann itself,
// on fixed cases and on random manifests (names with quotes, control characters and UTF-8,
// empty maps and lists, negative numbers, flat and box placements, every optional field).
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <random>
#include <string>

#include "format/checksum.h"
#include "format/json_text.h"
#include "format/manifest.h"

using namespace ckpt::format;
using nlohmann::json;

namespace {

// A document written with JsonText and the same one built as an nlohmann tree.
std::pair<std::string, json> Sample(int indent) {
  JsonText w(indent);
  w.BeginObject();
  w.Key("a");
  w.Integers(std::vector<int64_t>{-1, 0, 7});
  w.Key("b");
  w.BeginArray();
  w.EndArray();
  w.Key("c");
  w.StringMap({});
  w.Key("d \"quoted\"\n");
  w.StringMap({{"k", "tab\there"}, {"\xc3\xa9t\xc3\xa9", "\x01"}});
  w.Key("e");
  w.Double(1.5);
  w.Key("f");
  w.BeginArray();
  w.Pair<uint64_t>(1, 2);
  w.BeginObject();
  w.EndObject();
  w.Strings({"x", ""});
  w.EndArray();
  w.Key("g");
  w.Double(0);
  w.EndObject();
  json j = {{"a", {-1, 0, 7}},
            {"b", json::array()},
            {"c", json::object()},
            {"d \"quoted\"\n", {{"k", "tab\there"}, {"\xc3\xa9t\xc3\xa9", "\x01"}}},
            {"e", 1.5},
            {"f", {json::array({1, 2}), json::object(), json::array({"x", ""})}},
            {"g", 0.0}};
  return {w.Take(), j};
}

std::string RandomName(std::mt19937_64& rng) {
  static const std::vector<std::string> pieces = {"layers", ".", "0", "weight", "\"", "\\", "\n", "\x7f",
                                                  "\xc3\xa9", "\xe2\x82\xac", " ", "/", "\x1f", "_"};
  std::string s;
  for (size_t n = rng() % 6; n > 0; --n) s += pieces[rng() % pieces.size()];
  return s;
}

Manifest RandomManifest(std::mt19937_64& rng) {
  Manifest m;
  m.job = RandomName(rng);
  m.step = rng() % 1000000;
  m.unix_time = static_cast<double>(rng() % 2000000000) + static_cast<double>(rng() % 1000) / 1000.0;
  m.wall_time = "2026-11-27T07:00:00Z";
  m.ckptd_version = "0.4.0";
  m.run = rng();
  m.checksum_chunk_bytes = rng() % 2 ? 0 : 1 << 20;
  m.world_size = 1 + rng() % 4;
  for (size_t n = rng() % 3; n > 0; --n) m.metadata[RandomName(rng)] = RandomName(rng);
  for (uint32_t r = 0; r < m.world_size; ++r) {
    ManifestShard s;
    s.rank = r;
    s.file = ShardFileName(r);
    s.bytes = rng() % 100000;
    for (size_t n = rng() % 3; n > 0; --n) s.metadata[RandomName(rng)] = RandomName(rng);
    for (size_t n = rng() % 3; n > 0; --n) s.train_state[RandomName(rng)] = {rng() % 10, 10 + rng() % 10, "xxh3:00000000000000ab"};
    m.shards.push_back(s);
  }
  for (size_t n = rng() % 4; n > 0; --n) {
    ManifestTensor& t = m.tensors[RandomName(rng)];
    t.dtype = "BF16";
    t.global_shape = {static_cast<int64_t>(rng() % 9), 4};
    for (uint32_t r = 0; r < m.world_size; ++r) {
      TensorShard s{r, ShardFileName(r), rng() % 100, 100 + rng() % 100, {}, {2, 2}, "xxh3:0000000000000001", {}, {}};
      if (rng() % 2) {
        s.flat = {{0, 2}, {static_cast<int64_t>(rng() % 50) - 5, 60}};
      } else {
        s.offset = {-static_cast<int64_t>(rng() % 3), 0};
      }
      if (rng() % 2) s.chunk_checksums = {"xxh3:0000000000000002", "xxh3:0000000000000003"};
      t.shards.push_back(s);
    }
  }
  for (uint32_t node = 0; node < rng() % 3; ++node) m.nodes.push_back({node, {node, node + 1}});
  if (rng() % 2) m.scope = StepScope{1, 2, rng(), static_cast<uint32_t>(rng() % 100), "xxh3:00000000000000ff"};
  return m;
}

}  // namespace

TEST_CASE("JsonText writes what nlohmann dumps, indented and compact") {
  for (int indent : {-1, 0, 1, 4}) {
    auto [text, j] = Sample(indent);
    CHECK(text == j.dump(indent));
  }
}

TEST_CASE("a manifest's text is nlohmann's dump of itself, so its checksum verifies") {
  std::mt19937_64 rng(20261127);
  for (int i = 0; i < 500; ++i) {
    const Manifest m = RandomManifest(rng);
    const std::string text = ManifestToJson(m);
    INFO(text);
    REQUIRE(json::parse(text).dump(1) == text);
    // The checksum as ParseManifest checks it: of nlohmann's text with the field empty.
    json j = json::parse(text);
    const std::string sealed = j["manifest_checksum"];
    j["manifest_checksum"] = "";
    const std::string unsealed = j.dump(1);
    CHECK(sealed == ChecksumOf(unsealed.data(), unsealed.size()));
  }
}

TEST_CASE("JsonText refuses text that is not UTF-8, as nlohmann does") {
  JsonText w;
  CHECK_THROWS(w.String("\xff\xfe"));
}
