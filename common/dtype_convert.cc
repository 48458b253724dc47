#include "common/dtype_convert.h"

#include <fp16.h>

#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace ckpt {
namespace {

uint16_t Bf16FromFloat(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

float FloatFromBf16(uint16_t h) {
  uint32_t bits = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float Load(const std::string& dtype, const char* p) {
  if (dtype == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  if (dtype == "F64") {
    double d;
    std::memcpy(&d, p, 8);
    return static_cast<float>(d);
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == "BF16" ? FloatFromBf16(h) : fp16_ieee_to_fp32_value(h);
}

void Store(const std::string& dtype, float f, char* p) {
  if (dtype == "F32") {
    std::memcpy(p, &f, 4);
  } else if (dtype == "F64") {
    double d = f;
    std::memcpy(p, &d, 8);
  } else {
    uint16_t h = dtype == "BF16" ? Bf16FromFloat(f) : fp16_ieee_from_fp32_value(f);
    std::memcpy(p, &h, 2);
  }
}

// Of the floating-point dtypes converted here (IsFloat).
size_t FloatSize(const std::string& dtype) { return dtype == "F64" ? 8 : dtype == "F32" ? 4 : 2; }

}  // namespace

bool IsFloatDType(const std::string& dtype) {
  return dtype == "F64" || dtype == "F32" || dtype == "F16" || dtype == "BF16";
}

void ConvertElements(const std::string& from, const std::string& to, const void* src, void* dst,
                     size_t count) {
  if (from == to) {  // any dtype: integers, booleans and FP8 are never converted
    if (dst != src) std::memmove(dst, src, count * DTypeSize(from).value_or(1));
    return;
  }
  const size_t in = FloatSize(from), out = FloatSize(to);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  // F64 goes through float: an F64 tensor exported as F16 or BF16 loses more than that anyway.
  if (out <= in) {  // front to back, so that converting in place never overwrites unread input
    for (size_t i = 0; i < count; ++i) Store(to, Load(from, s + i * in), d + i * out);
  } else {
    for (size_t i = count; i-- > 0;) Store(to, Load(from, s + i * in), d + i * out);
  }
}

}  // namespace ckpt
