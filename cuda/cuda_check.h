// The one CUDA check macro (STYLE.md #4): on failure it returns a status naming the call,
// the CUDA error, the buffer and file:line, and clears the (non-sticky) error state.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "absl/status/status.h"

#define CKPT_CUDA_RETURN_IF_ERROR(expr, buffer)                                              \
  do {                                                                                       \
    cudaError_t _err = (expr);                                                               \
    if (_err != cudaSuccess) {                                                               \
      (void)cudaGetLastError();                                                              \
      return absl::InternalError(fmt::format("{} failed for {}: {} ({}) at {}:{}", #expr,   \
                                             (buffer), cudaGetErrorName(_err),               \
                                             cudaGetErrorString(_err), __FILE__, __LINE__)); \
    }                                                                                        \
  } while (0)
