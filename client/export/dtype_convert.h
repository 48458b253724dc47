// Floating-point dtype conversion for export (`ckptctl export --dtype`): a checkpoint keeps
// FP32 master weights, a model is shipped in BF16 or FP16.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::exporter {

// The dtype a tensor of `dtype` is exported as when `target` (F32, F16, BF16, or empty for
// "as saved") is asked for: floating-point tensors (F64, F32, F16, BF16) take `target`;
// integers, booleans and FP8 keep theirs. InvalidArgument for a target other than those.
absl::StatusOr<std::string> ExportDType(const std::string& dtype, const std::string& target);

// Converts `count` elements from `from` to `to` (both among F64, F32, F16, BF16; the same
// dtype copies; `dst` may be `src`). Rounds to nearest even, as PyTorch's .to() does; NaN stays NaN.
void ConvertElements(const std::string& from, const std::string& to, const void* src, void* dst,
                     size_t count);

}  // namespace ckpt::exporter
