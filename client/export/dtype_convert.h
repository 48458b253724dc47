// Floating-point dtype conversion for export (`ckptctl export --dtype`): a checkpoint keeps
// FP32 master weights, a model is shipped in BF16 or FP16.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "common/dtype_convert.h"

namespace ckpt::exporter {

// The dtype a tensor of `dtype` is exported as when `target` (F32, F16, BF16, or empty for
// "as saved") is asked for: floating-point tensors (F64, F32, F16, BF16) take `target`;
// integers, booleans and FP8 keep theirs. InvalidArgument for a target other than those.
absl::StatusOr<std::string> ExportDType(const std::string& dtype, const std::string& target);

// Conversion itself is common/dtype_convert.h's, shared with restores that cast.
using ::ckpt::ConvertElements;

}  // namespace ckpt::exporter
