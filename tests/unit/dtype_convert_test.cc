// Floating-point conversion (common/dtype_convert.h), as a restore with `cast` and
// `ckptctl export --dtype` use it: the values PyTorch's Tensor.to gives (rounded to nearest
// even), in place in both directions.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/dtype_convert.h"

using namespace ckpt;

namespace {

std::vector<char> Floats(const std::vector<float>& values, size_t room) {
  std::vector<char> bytes(std::max(room, values.size() * 4));
  std::memcpy(bytes.data(), values.data(), values.size() * 4);
  return bytes;
}

uint16_t Half(const std::vector<char>& bytes, size_t i) {
  uint16_t v;
  std::memcpy(&v, bytes.data() + i * 2, 2);
  return v;
}

}  // namespace

TEST_CASE("F32 to BF16 rounds to nearest even, keeps NaN and saturates to infinity") {
  // 1 + 2^-8 is halfway between two BF16 values: it goes to the even one (1.0); 1 + 3*2^-8
  // goes up to 1 + 2^-6. 3.4e38 rounds past BF16's largest finite value to infinity.
  std::vector<float> values = {1.0f, 1.00390625f, 1.01171875f, -2.0f, 3.4e38f,
                               std::numeric_limits<float>::quiet_NaN(), -0.0f};
  std::vector<char> bytes = Floats(values, 0);
  ConvertElements("F32", "BF16", bytes.data(), bytes.data(), values.size());
  CHECK(Half(bytes, 0) == 0x3f80);
  CHECK(Half(bytes, 1) == 0x3f80);
  CHECK(Half(bytes, 2) == 0x3f82);
  CHECK(Half(bytes, 3) == 0xc000);
  CHECK(Half(bytes, 4) == 0x7f80);
  CHECK((Half(bytes, 5) & 0x7f80) == 0x7f80);
  CHECK((Half(bytes, 5) & 0x007f) != 0);  // still a NaN, not infinity
  CHECK(Half(bytes, 6) == 0x8000);
}

TEST_CASE("widening in place reads every element before overwriting it") {
  std::vector<float> values;
  for (int i = 0; i < 1000; ++i) values.push_back(static_cast<float>(i % 256) - 128.0f);
  std::vector<char> bytes = Floats(values, values.size() * 8);
  ConvertElements("F32", "BF16", bytes.data(), bytes.data(), values.size());  // narrowing, forward
  ConvertElements("BF16", "F64", bytes.data(), bytes.data(), values.size());  // widening, backward
  for (size_t i = 0; i < values.size(); ++i) {
    double v;
    std::memcpy(&v, bytes.data() + i * 8, 8);
    REQUIRE(v == values[i]);  // integers up to 256 in magnitude are exact in BF16
  }
  ConvertElements("F64", "F16", bytes.data(), bytes.data(), values.size());
  ConvertElements("F16", "F32", bytes.data(), bytes.data(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    float v;
    std::memcpy(&v, bytes.data() + i * 4, 4);
    REQUIRE(v == values[i]);
  }
}

TEST_CASE("F16 overflows to infinity and keeps subnormals") {
  std::vector<float> values = {70000.0f, 6e-8f, 65504.0f};
  std::vector<char> bytes = Floats(values, 0);
  ConvertElements("F32", "F16", bytes.data(), bytes.data(), values.size());
  CHECK(Half(bytes, 0) == 0x7c00);
  CHECK(Half(bytes, 1) == 0x0001);  // the smallest subnormal, 2^-24
  CHECK(Half(bytes, 2) == 0x7bff);
}

TEST_CASE("the floating-point dtypes are the ones converted") {
  for (const char* dtype : {"F64", "F32", "F16", "BF16"}) CHECK(IsFloatDType(dtype));
  for (const char* dtype : {"I64", "I32", "U8", "BOOL", "F8_E4M3"}) CHECK_FALSE(IsFloatDType(dtype));
}
