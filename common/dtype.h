// safetensors dtypes and the size check shared by the client, the daemon and the format code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt {

// Bytes per element of a safetensors dtype ("F32" -> 4); InvalidArgument for unknown ones.
absl::StatusOr<size_t> DTypeSize(const std::string& dtype);

// prod(shape) * itemsize(dtype); InvalidArgument, naming the tensor, for an unknown dtype,
// a negative dimension or an absurd size.
absl::StatusOr<uint64_t> TensorBytes(const std::string& name, const std::string& dtype,
                                     const std::vector<int64_t>& shape);

// Checks that nbytes == prod(shape) * itemsize(dtype) and that no dimension is negative.
absl::Status CheckTensorBytes(const std::string& name, const std::string& dtype,
                              const std::vector<int64_t>& shape, uint64_t nbytes);

}  // namespace ckpt
