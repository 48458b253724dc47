// The small parts of ckptctl export: dtype conversion, rename rules, sizes.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "client/export/dtype_convert.h"
#include "client/export/exporter.h"
#include "client/export/rename_rules.h"

using namespace ckpt::exporter;

namespace {

uint16_t Bf16(float f) {
  uint16_t out;
  ConvertElements("F32", "BF16", &f, &out, 1);
  return out;
}

}  // namespace

TEST_CASE("F32 to BF16 rounds to nearest even and keeps NaN a NaN") {
  CHECK(Bf16(1.0f) == 0x3f80);
  uint32_t halfway = 0x3f808000;  // exactly between 0x3f80 and 0x3f81: even wins
  float f;
  std::memcpy(&f, &halfway, 4);
  CHECK(Bf16(f) == 0x3f80);
  uint32_t above = 0x3f808001;
  std::memcpy(&f, &above, 4);
  CHECK(Bf16(f) == 0x3f81);
  CHECK((Bf16(std::numeric_limits<float>::quiet_NaN()) & 0x7fc0) == 0x7fc0);
  CHECK(Bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
}

TEST_CASE("conversion in place widens and narrows; other dtypes are copied, whatever their size") {
  std::vector<char> buffer(4 * 4);
  const uint16_t halves[4] = {0x3c00, 0xc000, 0x0000, 0x7bff};  // F16: 1, -2, 0, 65504
  std::memcpy(buffer.data(), halves, sizeof halves);
  ConvertElements("F16", "F32", buffer.data(), buffer.data(), 4);
  float wide[4];
  std::memcpy(wide, buffer.data(), sizeof wide);
  CHECK(wide[0] == 1.0f);
  CHECK(wide[1] == -2.0f);
  CHECK(wide[3] == 65504.0f);
  ConvertElements("F32", "F16", buffer.data(), buffer.data(), 4);
  CHECK(std::memcmp(buffer.data(), halves, sizeof halves) == 0);
  // BOOL and I64 are copied byte for byte: a 1-byte dtype copies exactly its bytes.
  std::vector<char> flags = {1, 0, 1}, out(3, 9);
  ConvertElements("BOOL", "BOOL", flags.data(), out.data(), 3);
  CHECK(out == flags);
  CHECK(*ExportDType("BOOL", "BF16") == "BOOL");
  CHECK(*ExportDType("I64", "F16") == "I64");
  CHECK(*ExportDType("F32", "BF16") == "BF16");
  CHECK(*ExportDType("BF16", "") == "BF16");
  CHECK_FALSE(ExportDType("F32", "I8").ok());
}

TEST_CASE("rename rules: exact names beat prefixes, the longest prefix wins, \"\" leaves out") {
  auto rules = RenameRules::Parse(
      R"({"layers.*": "model.layers.*", "layers.0.*": "first.*", "tok.weight": "model.embed.weight",
          "optim.*": ""})",
      "r.json");
  REQUIRE(rules.ok());
  CHECK(*rules->Apply("layers.3.w") == "model.layers.3.w");
  CHECK(*rules->Apply("layers.0.w") == "first.w");
  CHECK(*rules->Apply("tok.weight") == "model.embed.weight");
  CHECK(*rules->Apply("norm.weight") == "norm.weight");
  CHECK_FALSE(rules->Apply("optim.layers.0.w.exp_avg").has_value());
  for (const char* bad : {"[1, 2]", R"({"a": 3})", R"({"a*b": "c"})", R"({"a.*": "b"})", R"({"a": "b*"})", "{"}) {
    auto refused = RenameRules::Parse(bad, "r.json");
    INFO(bad);
    CHECK_FALSE(refused.ok());
    CHECK(std::string(refused.status().message()).find("r.json") != std::string::npos);
  }
}

TEST_CASE("sizes as Hugging Face writes them, and nonsense refused") {
  CHECK(*ParseByteSize("5GB") == 5'000'000'000);
  CHECK(*ParseByteSize("500MB") == 500'000'000);
  CHECK(*ParseByteSize("2GiB") == uint64_t{2} << 30);
  CHECK(*ParseByteSize("64mib") == uint64_t{64} << 20);
  CHECK(*ParseByteSize("4096") == 4096);
  for (const char* bad : {"", "GB", "5TB", "0", "-1GB", "999999999999GiB", "1.5GB"}) {
    INFO(bad);
    CHECK_FALSE(ParseByteSize(bad).ok());
  }
  CHECK(ParseExportFormat("hf").ok());
  CHECK_FALSE(ParseExportFormat("gguf").ok());
}
