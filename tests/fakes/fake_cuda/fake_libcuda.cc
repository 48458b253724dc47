// A stand-in for the CUDA driver (libcuda.so.1) that says what the test tells it, so that a
// real ckptd's start-up check is tried without a GPU: $FAKE_CUDA_VERSION is the version it
// reports (12040 for CUDA 12.4) and $FAKE_CUDA_INIT the CUresult cuInit returns (100:
// CUDA_ERROR_NO_DEVICE). It has no devices and serves no entry point: a driver that passes
// the version check and initialises would find none, as ckptd then says.
#include <cstdlib>

extern "C" {

__attribute__((visibility("default"))) int cuDriverGetVersion(int* version) {
  const char* v = std::getenv("FAKE_CUDA_VERSION");
  *version = v != nullptr ? std::atoi(v) : 0;
  return 0;
}

__attribute__((visibility("default"))) int cuInit(unsigned int) {
  const char* r = std::getenv("FAKE_CUDA_INIT");
  return r != nullptr ? std::atoi(r) : 100;
}

__attribute__((visibility("default"))) int cuGetProcAddress_v2(const char*, void** fn, int, unsigned long long,
                                                               int* found) {
  *fn = nullptr;
  if (found != nullptr) *found = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
  return 500;                        // CUDA_ERROR_NOT_FOUND
}

}  // extern "C"
