// Runs on a GPU host; elsewhere it reports itself skipped (tools/test.sh counts it so),
// never as passed.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <vector>

#include "cuda/copy_engine.h"
#include "cuda/cuda_copy_engine.h"
#include "cuda/device.h"
#include "cuda/staging_pool.h"

using namespace ckpt::cuda;

TEST_CASE("device-to-host and host-to-device copies through the CUDA engine are exact") {
  if (!DetectDevices().available()) {
    std::cout << "SKIPPED: no CUDA device (" << DetectDevices().reason << ")\n";
    return;
  }
  auto engine = MakeCudaCopyEngine({.device = 0, .streams = 4, .chunk_bytes = 1 << 20});
  REQUIRE(engine.ok());
  auto pool = StagingPool::Create(64 << 20, true);
  REQUIRE(pool.ok());
  REQUIRE((*pool)->PinForCuda().ok());
  const size_t n = (40u << 20) + 12;
  std::vector<uint8_t> pattern(n);
  std::iota(pattern.begin(), pattern.end(), 7);
  void* dev = nullptr;
  REQUIRE(cudaMalloc(&dev, n) == cudaSuccess);
  REQUIRE(cudaMemcpy(dev, pattern.data(), n, cudaMemcpyHostToDevice) == cudaSuccess);
  auto block = (*pool)->Allocate(n);
  REQUIRE(block.ok());
  CopyRegion d2h{(*block)->data(), dev, n};
  REQUIRE((*engine)->Copy({&d2h, 1}).ok());
  CHECK(std::memcmp((*block)->data(), pattern.data(), n) == 0);
  REQUIRE(cudaMemset(dev, 0, n) == cudaSuccess);
  CopyRegion h2d{dev, (*block)->data(), n};
  REQUIRE((*engine)->Copy({&h2d, 1}).ok());
  std::vector<uint8_t> back(n);
  REQUIRE(cudaMemcpy(back.data(), dev, n, cudaMemcpyDeviceToHost) == cudaSuccess);
  // memcmp, not ==: Catch would print both 40 MiB vectors on a failure.
  CHECK(std::memcmp(back.data(), pattern.data(), n) == 0);
  cudaFree(dev);
}

TEST_CASE("without a usable device the engine says so instead of failing later") {
  if (DetectDevices().available()) return;  // covered above
  auto engine = MakeCudaCopyEngine({.device = 0});
  REQUIRE_FALSE(engine.ok());
  // Names why: no driver here, or no device.
  CHECK(std::string(engine.status().message()).find(DetectDevices().reason.empty() ? "not usable" : "CUDA") !=
        std::string::npos);
  auto pool = StagingPool::Create(1 << 20, false);
  REQUIRE(pool.ok());
  auto pinned = (*pool)->PinForCuda();
  CHECK_FALSE(pinned.ok());
  CHECK(std::string(pinned.message()).find("pinning the staging pool") != std::string::npos);
}
