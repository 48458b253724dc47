#include "client/export/dtype_convert.h"

#include <fmt/format.h>

#include "common/dtype_convert.h"

namespace ckpt::exporter {

absl::StatusOr<std::string> ExportDType(const std::string& dtype, const std::string& target) {
  if (target.empty()) return dtype;
  if (target != "F32" && target != "F16" && target != "BF16") {
    return absl::InvalidArgumentError(
        fmt::format("cannot export as dtype {}: the choices are F32, F16 and BF16", target));
  }
  return IsFloatDType(dtype) ? target : dtype;
}

}  // namespace ckpt::exporter
