// Converting floating-point tensors between safetensors dtypes (F64, F32, F16, BF16), as
// PyTorch's Tensor.to does: round to nearest even, NaN kept NaN, overflow to infinity. What
// `ckptctl export --dtype` ships a model in, and what a restore with `cast` reads a tensor
// saved in another dtype as (a BF16 weights-only step into an FP32 model).
#pragma once

#include <cstddef>
#include <string>

namespace ckpt {

// F64, F32, F16 or BF16: the dtypes ConvertElements converts between.
bool IsFloatDType(const std::string& dtype);

// Converts `count` elements from `from` to `to` (both floating point, or the same dtype of
// any kind, which copies). `dst` may be `src`: converting in place never overwrites input
// not yet read, when `src` has room for the wider of the two.
void ConvertElements(const std::string& from, const std::string& to, const void* src, void* dst,
                     size_t count);

}  // namespace ckpt
