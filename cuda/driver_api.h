// The CUDA driver API, loaded when first needed from the node's driver (libcuda.so.1, which
// every GPU node has: it comes with the driver), its entry points found by cuGetProcAddress
// at the ABI of kMinCudaVersion. Nothing of CUDA is linked: one build runs with any driver
// from R525 (CUDA 12.0) on, whatever CUDA runtime the trainers bring (PyTorch's wheels carry
// their own), and on machines with no driver at all, where Driver() is null and ckptd runs
// its host path. docs/architecture.md ("CUDA at run time") says why the driver API.
//
// Only the types come from CUDA's headers (cuda.h); each entry point below is declared with
// the signature of the header's function of that name (decltype), so that a signature that
// changes between toolkits fails the build instead of a call.
#pragma once

#include <cuda.h>

#include <string>

namespace ckpt::cuda {

// The CUDA version whose driver API ckptd uses, and so the oldest driver it runs GPU copies
// on: 12.0, drivers R525 and newer.
inline constexpr int kMinCudaVersion = 12000;
inline constexpr const char* kMinDriverName = "R525 (CUDA 12.0)";

struct DriverApi {
  int version = 0;  // cuDriverGetVersion: 12040 for CUDA 12.4

#define CKPT_CUDA_DRIVER_ENTRY(name) decltype(&::name) name = nullptr
  CKPT_CUDA_DRIVER_ENTRY(cuGetErrorName);
  CKPT_CUDA_DRIVER_ENTRY(cuGetErrorString);
  CKPT_CUDA_DRIVER_ENTRY(cuDeviceGetCount);
  CKPT_CUDA_DRIVER_ENTRY(cuDeviceGet);
  CKPT_CUDA_DRIVER_ENTRY(cuDeviceGetUuid);
  CKPT_CUDA_DRIVER_ENTRY(cuDevicePrimaryCtxRetain);
  CKPT_CUDA_DRIVER_ENTRY(cuCtxGetCurrent);
  CKPT_CUDA_DRIVER_ENTRY(cuCtxSetCurrent);
  CKPT_CUDA_DRIVER_ENTRY(cuStreamCreate);
  CKPT_CUDA_DRIVER_ENTRY(cuStreamDestroy);
  CKPT_CUDA_DRIVER_ENTRY(cuStreamSynchronize);
  CKPT_CUDA_DRIVER_ENTRY(cuStreamWaitEvent);
  CKPT_CUDA_DRIVER_ENTRY(cuStreamWaitValue64);
  CKPT_CUDA_DRIVER_ENTRY(cuLaunchHostFunc);
  CKPT_CUDA_DRIVER_ENTRY(cuMemcpyAsync);
  CKPT_CUDA_DRIVER_ENTRY(cuMemHostRegister);
  CKPT_CUDA_DRIVER_ENTRY(cuMemHostUnregister);
  CKPT_CUDA_DRIVER_ENTRY(cuMemHostGetDevicePointer);
  CKPT_CUDA_DRIVER_ENTRY(cuEventCreate);
  CKPT_CUDA_DRIVER_ENTRY(cuEventDestroy);
  CKPT_CUDA_DRIVER_ENTRY(cuEventRecord);
  CKPT_CUDA_DRIVER_ENTRY(cuIpcGetMemHandle);
  CKPT_CUDA_DRIVER_ENTRY(cuIpcOpenMemHandle);
  CKPT_CUDA_DRIVER_ENTRY(cuIpcCloseMemHandle);
  CKPT_CUDA_DRIVER_ENTRY(cuIpcGetEventHandle);
  CKPT_CUDA_DRIVER_ENTRY(cuIpcOpenEventHandle);
  CKPT_CUDA_DRIVER_ENTRY(cuPointerGetAttribute);
#undef CKPT_CUDA_DRIVER_ENTRY
};

// The driver API of this process, loaded and initialised (cuInit) once; null where there is
// none to use, with why in DriverProblem().
const DriverApi* Driver();
// Why Driver() is null, as a sentence naming what was found and what is needed (no
// libcuda.so.1; a driver older than kMinDriverName; cuInit failed, as with no device); empty
// when it is not.
const std::string& DriverProblem();
// "12.4" for 12040.
std::string CudaVersionName(int version);
// "CUDA_ERROR_INVALID_VALUE: invalid argument" for a CUresult (the driver's own words when
// it is loaded).
std::string CudaErrorText(CUresult result);

}  // namespace ckpt::cuda
