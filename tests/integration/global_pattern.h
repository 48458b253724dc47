// The values of the resharding tests' global tensors: a 4-byte value per global element of
// each tensor, the same whatever the world size or placement that holds it
// (reshard_helper.cc saves and checks it; export_test.cc and check_export.py check exports).
#pragma once

#include <cstdint>

namespace ckpt::testing {

inline uint32_t GlobalValue(uint32_t tensor, uint64_t element) {
  uint64_t x = (element + 1) * 0x9E3779B97F4A7C15ULL ^ (uint64_t{tensor} << 58);
  x ^= x >> 31;
  return static_cast<uint32_t>(x * 0xBF58476D1CE4E5B9ULL >> 32);
}

}  // namespace ckpt::testing
