#include "cuda/driver_api.h"

#include <dlfcn.h>
#include <fmt/format.h>

namespace ckpt::cuda {
namespace {

struct Loaded {
  DriverApi api;
  std::string problem;  // empty: api is usable
};

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using DriverGetVersionFn = CUresult (*)(int*);
using InitFn = CUresult (*)(unsigned int);

// One entry point at kMinCudaVersion's ABI, into `slot`; false (with why) when missing.
template <typename Fn>
bool Resolve(GetProcAddressFn get, const char* symbol, Fn& slot, std::string& problem) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  if (get(symbol, &fn, kMinCudaVersion, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
      found != CU_GET_PROC_ADDRESS_SUCCESS || fn == nullptr) {
    problem = fmt::format("the CUDA driver has no {} at CUDA {}'s ABI", symbol, CudaVersionName(kMinCudaVersion));
    return false;
  }
  slot = reinterpret_cast<Fn>(fn);
  return true;
}

Loaded Load() {
  Loaded out;
  // RTLD_LOCAL: the driver's symbols stay out of the process's namespace (a trainer's own
  // CUDA runtime finds the same library by itself). Never closed: contexts outlive callers.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    out.problem = fmt::format("no CUDA driver on this machine (libcuda.so.1: {})", why ? why : "not found");
    return out;
  }
  auto driver_version = reinterpret_cast<DriverGetVersionFn>(::dlsym(lib, "cuDriverGetVersion"));
  int version = 0;
  if (driver_version == nullptr || driver_version(&version) != CUDA_SUCCESS) {
    out.problem = "the CUDA driver (libcuda.so.1) does not say its version";
    return out;
  }
  out.api.version = version;
  if (version < kMinCudaVersion) {
    out.problem = fmt::format("the CUDA driver supports CUDA {}; ckptd needs a driver for CUDA {} or newer ({})",
                              CudaVersionName(version), CudaVersionName(kMinCudaVersion), kMinDriverName);
    return out;
  }
  // CUDA 12.0 drivers and newer export the five-argument cuGetProcAddress under this name.
  auto get = reinterpret_cast<GetProcAddressFn>(::dlsym(lib, "cuGetProcAddress_v2"));
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "cuInit"));
  if (get == nullptr || init == nullptr) {
    out.problem = fmt::format("the CUDA driver (CUDA {}) has no cuGetProcAddress_v2 or cuInit",
                              CudaVersionName(version));
    return out;
  }
  if (CUresult r = init(0); r != CUDA_SUCCESS) {
    out.problem = fmt::format("the CUDA driver (CUDA {}) did not initialise: CUresult {}{}", CudaVersionName(version),
                              static_cast<int>(r), r == CUDA_ERROR_NO_DEVICE ? " (no CUDA device)" : "");
    return out;
  }
  DriverApi& a = out.api;
  std::string& p = out.problem;
  const bool all =
      Resolve(get, "cuGetErrorName", a.cuGetErrorName, p) && Resolve(get, "cuGetErrorString", a.cuGetErrorString, p) &&
      Resolve(get, "cuDeviceGetCount", a.cuDeviceGetCount, p) && Resolve(get, "cuDeviceGet", a.cuDeviceGet, p) &&
      Resolve(get, "cuDeviceGetUuid", a.cuDeviceGetUuid, p) &&
      Resolve(get, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain, p) &&
      Resolve(get, "cuCtxGetCurrent", a.cuCtxGetCurrent, p) && Resolve(get, "cuCtxSetCurrent", a.cuCtxSetCurrent, p) &&
      Resolve(get, "cuStreamCreate", a.cuStreamCreate, p) && Resolve(get, "cuStreamDestroy", a.cuStreamDestroy, p) &&
      Resolve(get, "cuStreamSynchronize", a.cuStreamSynchronize, p) &&
      Resolve(get, "cuStreamWaitEvent", a.cuStreamWaitEvent, p) &&
      Resolve(get, "cuStreamWaitValue64", a.cuStreamWaitValue64, p) &&
      Resolve(get, "cuLaunchHostFunc", a.cuLaunchHostFunc, p) && Resolve(get, "cuMemcpyAsync", a.cuMemcpyAsync, p) &&
      Resolve(get, "cuMemHostRegister", a.cuMemHostRegister, p) &&
      Resolve(get, "cuMemHostUnregister", a.cuMemHostUnregister, p) &&
      Resolve(get, "cuMemHostGetDevicePointer", a.cuMemHostGetDevicePointer, p) &&
      Resolve(get, "cuEventCreate", a.cuEventCreate, p) && Resolve(get, "cuEventDestroy", a.cuEventDestroy, p) &&
      Resolve(get, "cuEventRecord", a.cuEventRecord, p) && Resolve(get, "cuIpcGetMemHandle", a.cuIpcGetMemHandle, p) &&
      Resolve(get, "cuIpcOpenMemHandle", a.cuIpcOpenMemHandle, p) &&
      Resolve(get, "cuIpcCloseMemHandle", a.cuIpcCloseMemHandle, p) &&
      Resolve(get, "cuIpcGetEventHandle", a.cuIpcGetEventHandle, p) &&
      Resolve(get, "cuIpcOpenEventHandle", a.cuIpcOpenEventHandle, p) &&
      Resolve(get, "cuPointerGetAttribute", a.cuPointerGetAttribute, p);
  if (!all) out.api = DriverApi{.version = version};
  return out;
}

const Loaded& Get() {
  static const Loaded loaded = Load();
  return loaded;
}

}  // namespace

const DriverApi* Driver() {
  const Loaded& l = Get();
  return l.problem.empty() ? &l.api : nullptr;
}

const std::string& DriverProblem() { return Get().problem; }

std::string CudaVersionName(int version) { return fmt::format("{}.{}", version / 1000, (version % 1000) / 10); }

std::string CudaErrorText(CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (const DriverApi* d = Driver()) {
    (void)d->cuGetErrorName(result, &name);
    (void)d->cuGetErrorString(result, &text);
  }
  if (name == nullptr) return fmt::format("CUresult {}", static_cast<int>(result));
  return fmt::format("{}: {}", name, text ? text : "");
}

}  // namespace ckpt::cuda
