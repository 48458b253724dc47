// Casting floating-point tensors between safetensors dtypes (F64, F32, F16, BF16) in place,
// as PyTorch's Tensor.to(dtype) does: round to nearest even, NaN kept NaN, overflow to
// infinity. A restore uses it when the trainer asks for it (a weights-only checkpoint saved
// in BF16 loaded into an FP32 model); integers and booleans are never cast.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"

namespace ckpt {

// Whether a tensor saved as `from` can be cast to `to` (both floating point).
bool CanCast(const std::string& from, const std::string& to);

// Rewrites `count` elements of `from` starting at `data` as elements of `to`, from the same
// address. `data` must hold max(count * size(from), count * size(to)) bytes.
absl::Status CastInPlace(char* data, size_t count, const std::string& from, const std::string& to);

}  // namespace ckpt
