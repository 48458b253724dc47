#include "common/dtype_cast.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ckpt {
namespace {

enum class Float { kF64, kF32, kF16, kBF16, kNone };

Float Kind(const std::string& dtype) {
  if (dtype == "F64") return Float::kF64;
  if (dtype == "F32") return Float::kF32;
  if (dtype == "F16") return Float::kF16;
  if (dtype == "BF16") return Float::kBF16;
  return Float::kNone;
}

size_t Size(Float f) { return f == Float::kF64 ? 8 : f == Float::kF32 ? 4 : 2; }

// Element i of `data` as a double: every value of the four types is exact in a double.
double Load(const char* data, size_t i, Float f) {
  switch (f) {
    case Float::kF64: {
      double v;
      std::memcpy(&v, data + i * 8, 8);
      return v;
    }
    case Float::kF32: {
      float v;
      std::memcpy(&v, data + i * 4, 4);
      return v;
    }
    case Float::kF16: {
      _Float16 v;
      std::memcpy(&v, data + i * 2, 2);
      return static_cast<double>(v);
    }
    case Float::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, data + i * 2, 2);
      uint32_t wide = static_cast<uint32_t>(bits) << 16;
      float v;
      std::memcpy(&v, &wide, 4);
      return v;
    }
    case Float::kNone: break;
  }
  return 0;
}

// BF16 is the upper half of an F32: rounded to nearest even, as PyTorch rounds.
uint16_t ToBF16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (std::isnan(v)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // stays a (quiet) NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

void Store(char* data, size_t i, Float f, double v) {
  switch (f) {
    case Float::kF64:
      std::memcpy(data + i * 8, &v, 8);
      return;
    case Float::kF32: {
      float x = static_cast<float>(v);
      std::memcpy(data + i * 4, &x, 4);
      return;
    }
    case Float::kF16: {
      // Through float, as PyTorch converts: a double rounded twice could differ from it.
      _Float16 x = static_cast<_Float16>(static_cast<float>(v));
      std::memcpy(data + i * 2, &x, 2);
      return;
    }
    case Float::kBF16: {
      uint16_t x = ToBF16(static_cast<float>(v));
      std::memcpy(data + i * 2, &x, 2);
      return;
    }
    case Float::kNone: return;
  }
}

}  // namespace

bool CanCast(const std::string& from, const std::string& to) {
  return Kind(from) != Float::kNone && Kind(to) != Float::kNone;
}

absl::Status CastInPlace(char* data, size_t count, const std::string& from, const std::string& to) {
  const Float src = Kind(from), dst = Kind(to);
  if (src == Float::kNone || dst == Float::kNone) {
    return absl::InvalidArgumentError(fmt::format(
        "cannot cast {} to {}: only floating-point tensors (F64, F32, F16, BF16) are cast", from, to));
  }
  if (src == dst) return absl::OkStatus();
  // Widening writes past each element read: go from the last element back, so that what
  // is written covers only elements already read. Narrowing goes forward for the same reason.
  if (Size(dst) > Size(src)) {
    for (size_t i = count; i-- > 0;) Store(data, i, dst, Load(data, i, src));
  } else {
    for (size_t i = 0; i < count; ++i) Store(data, i, dst, Load(data, i, src));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
