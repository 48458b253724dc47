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
