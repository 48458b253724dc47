#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/status.h"
#include "format/safetensors.h"
#include "storage/local_store.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;
using namespace ckpt::format;

namespace {

std::string WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

absl::StatusOr<SafetensorsHeader> Parse(const std::string& path) {
  auto object = storage::MakeLocalStore(MakePosixFilesystem(), "")->Open(path);
  REQUIRE(object.ok());
  return ReadHeader(**object);
}

std::vector<TensorEntry> TwoTensors() {
  return {{"a", "F32", {2, 3}, 0, 24}, {"b", "I64", {1}, 24, 32}};
}

}  // namespace

TEST_CASE("header round-trips and the data region starts 8-byte aligned") {
  testing::TempDir dir;
  std::string header = EncodeHeader(TwoTensors(), {{"step", "7"}});
  CHECK(header.size() % 8 == 0);
  std::string path = WriteFile(dir / "x.safetensors", header + std::string(32, '\x01'));
  auto parsed = Parse(path);
  REQUIRE(parsed.ok());
  CHECK(parsed->data_start == header.size());
  CHECK(parsed->data_bytes == 32);
  REQUIRE(parsed->tensors.size() == 2);
  CHECK(parsed->tensors[0].name == "a");
  CHECK(parsed->tensors[0].shape == std::vector<int64_t>{2, 3});
  CHECK(parsed->tensors[1].dtype == "I64");
  CHECK(parsed->metadata.at("step") == "7");
}

TEST_CASE("the header is JSON as the safetensors spec defines it") {
  std::string header = EncodeHeader(TwoTensors(), {});
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(header[i]);
  CHECK(n == header.size() - 8);
  auto j = nlohmann::json::parse(header.substr(8));
  CHECK(j["a"]["data_offsets"] == nlohmann::json({0, 24}));
  CHECK_FALSE(j.contains("__metadata__"));  // omitted when empty
}

// The header is written as text directly (an ordered_json tree finds each key by a linear
// search: quadratic in an increment's tens of thousands of entries); it must stay the text
// that tree wrote, entries in data order, names escaped.
TEST_CASE("the header's text is what an ordered JSON tree of the same entries would write") {
  std::vector<TensorEntry> entries = {{"z.weight", "BF16", {4096, 1024}, 0, 8388608},
                                      {"a \"quoted\"\\name\n\u00e9", "F32", {}, 8388608, 8388612},
                                      {"__delta__.z.weight.3", "I8", {-1 + 2, 7}, 8388612, 8388619}};
  const std::map<std::string, std::string> metadata = {{"step", "7"}, {"ckptd.run", "\t9"}};
  for (const auto& meta : {metadata, std::map<std::string, std::string>{}}) {
    nlohmann::ordered_json tree = nlohmann::ordered_json::object();
    if (!meta.empty()) tree["__metadata__"] = meta;
    for (const TensorEntry& t : entries) {
      tree[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
    }
    const std::string header = EncodeHeader(entries, meta, 4096);
    CHECK(header.size() % 4096 == 0);
    const std::string json = tree.dump();
    CHECK(header.substr(8, json.size()) == json);
    CHECK(header.find_first_not_of(' ', 8 + json.size()) == std::string::npos);  // padding only
  }
}

TEST_CASE("a header over safetensors' 100,000,000 bytes is refused before it is written, naming the file") {
  CHECK(CheckHeaderFits(EncodeHeader(TwoTensors(), {}), 2, "rank-00000.safetensors").ok());
  std::string at_limit(8 + kMaxWrittenHeaderBytes, ' ');
  CHECK(CheckHeaderFits(at_limit, 1, "rank-00000.safetensors").ok());
  at_limit.push_back(' ');
  absl::Status over = CheckHeaderFits(at_limit, 170000, "/root/job/step-00000001.tmp/rank-00007.safetensors");
  CHECK(absl::IsResourceExhausted(over));
  CHECK(Message(over).find("rank-00007.safetensors") != std::string::npos);
  CHECK(Message(over).find("100000001 bytes (170000 entries)") != std::string::npos);
  CHECK(Message(over).find("over the 100000000 bytes safetensors readers accept") != std::string::npos);
}

TEST_CASE("a truncated shard is refused with the file named") {
  testing::TempDir dir;
  std::string header = EncodeHeader(TwoTensors(), {});
  std::string path = WriteFile(dir / "t.safetensors", header + std::string(20, '\0'));
  auto parsed = Parse(path);
  REQUIRE_FALSE(parsed.ok());
  CHECK(absl::IsDataLoss(parsed.status()));
  CHECK(Message(parsed.status()).find("t.safetensors") != std::string::npos);
  CHECK(Message(parsed.status()).find("truncated") != std::string::npos);
}

TEST_CASE("holes, overlaps, bad sizes and bad JSON are refused") {
  testing::TempDir dir;
  auto check_bad = [&](const std::vector<TensorEntry>& entries, size_t data, const char* why) {
    std::string path = WriteFile(dir / "b.safetensors", EncodeHeader(entries, {}) + std::string(data, '\0'));
    auto parsed = Parse(path);
    INFO(why);
    CHECK_FALSE(parsed.ok());
  };
  check_bad({{"a", "F32", {2}, 0, 8}, {"b", "F32", {2}, 12, 20}}, 20, "hole");
  check_bad({{"a", "F32", {3}, 0, 8}}, 8, "shape does not match bytes");
  check_bad({{"a", "Q7", {2}, 0, 8}}, 8, "unknown dtype");
  std::string garbage = std::string("\x10\0\0\0\0\0\0\0", 8) + "{not json here!!";
  CHECK_FALSE(Parse(WriteFile(dir / "g.safetensors", garbage)).ok());
  std::string huge = std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}";
  CHECK_FALSE(Parse(WriteFile(dir / "h.safetensors", huge)).ok());
  CHECK_FALSE(Parse(WriteFile(dir / "s.safetensors", "abc")).ok());
}

TEST_CASE("tensor byte counts are checked against shape and dtype") {
  CHECK(CheckTensorBytes("w", "BF16", {4, 4}, 32).ok());
  CHECK(CheckTensorBytes("s", "F32", {}, 4).ok());  // a scalar
  absl::Status s = CheckTensorBytes("w", "F32", {4, 4}, 60);
  CHECK(absl::IsInvalidArgument(s));
  CHECK(Message(s).find("tensor w: size mismatch") != std::string::npos);
  CHECK_FALSE(CheckTensorBytes("w", "F32", {-1}, 4).ok());
  CHECK_FALSE(CheckTensorBytes("w", "F32", {1ll << 40, 1ll << 40}, 0).ok());
}
