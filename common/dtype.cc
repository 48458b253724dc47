#include "common/dtype.h"

#include <fmt/format.h>

#include <map>

#include "common/status.h"

namespace ckpt {
namespace {

const std::map<std::string, size_t>& DTypes() {
  static const std::map<std::string, size_t> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},
      {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
      {"F64", 8},  {"I64", 8}, {"U64", 8}};
  return kSizes;
}

}  // namespace

absl::StatusOr<size_t> DTypeSize(const std::string& dtype) {
  auto it = DTypes().find(dtype);
  if (it == DTypes().end()) {
    return absl::InvalidArgumentError(fmt::format("unknown dtype \"{}\"", dtype.substr(0, 32)));
  }
  return it->second;
}

absl::StatusOr<uint64_t> TensorBytes(const std::string& name, const std::string& dtype,
                                     const std::vector<int64_t>& shape) {
  auto itemsize = DTypeSize(dtype);
  if (!itemsize.ok()) return Annotate(itemsize.status(), fmt::format("tensor {}", name));
  unsigned __int128 bytes = *itemsize;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          fmt::format("tensor {}: negative dimension in shape [{}]", name, fmt::join(shape, ", ")));
    }
    bytes *= static_cast<uint64_t>(d);
    if (bytes > (static_cast<unsigned __int128>(1) << 62)) {
      return absl::InvalidArgumentError(fmt::format("tensor {}: shape too large", name));
    }
  }
  return static_cast<uint64_t>(bytes);
}

absl::Status CheckTensorBytes(const std::string& name, const std::string& dtype,
                              const std::vector<int64_t>& shape, uint64_t nbytes) {
  CKPT_ASSIGN_OR_RETURN(uint64_t expected, TensorBytes(name, dtype, shape));
  if (expected != nbytes) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: size mismatch: {} [{}] needs {} bytes, buffer has {}", name, dtype,
        fmt::join(shape, ", "), expected, nbytes));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
