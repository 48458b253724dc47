// The one CUDA check macro (STYLE.md #4): on failure it returns a status naming the call,
// the CUDA error (the driver's own name and words), the buffer and file:line. The driver API
// keeps no sticky per-thread error to clear.
#pragma once

#include <cuda.h>
#include <fmt/format.h>

#include "absl/status/status.h"
#include "cuda/driver_api.h"

#define CKPT_CUDA_RETURN_IF_ERROR(expr, buffer)                                                           \
  do {                                                                                                    \
    CUresult _ckpt_cu_result = (expr);                                                                    \
    if (_ckpt_cu_result != CUDA_SUCCESS) {                                                                \
      return absl::InternalError(fmt::format("{} failed for {}: {} at {}:{}", #expr, (buffer),           \
                                             ::ckpt::cuda::CudaErrorText(_ckpt_cu_result), __FILE__, __LINE__)); \
    }                                                                                                     \
  } while (0)

// The driver of this process, or FailedPrecondition naming why there is none, for `what`.
#define CKPT_CUDA_DRIVER_OR_RETURN(var, what)                                                         \
  const ::ckpt::cuda::DriverApi* var = ::ckpt::cuda::Driver();                                        \
  if (var == nullptr) {                                                                               \
    return absl::FailedPreconditionError(fmt::format("{}: {}", (what), ::ckpt::cuda::DriverProblem())); \
  }
