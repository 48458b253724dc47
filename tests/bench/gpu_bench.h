// The GPU part of ckpt_bench (--gpu): pinned copy limits, ckptd staging and hot restore of
// GPU buffers through CUDA IPC, and the step-time overhead of a snapshot every step.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

namespace ckpt::bench {

struct GpuBenchOptions {
  std::string socket;          // a running ckptd
  uint64_t bytes = 8ull << 30; // GPU state checkpointed
  int step_ms = 100;           // busy GPU time per synthetic training step
  int steps = 20;
  // A snapshot every this many steps in the training loop: every step asks the disk to keep
  // up with the GPU (1 GiB a step), and the snapshots it cannot take are refused, not copied.
  int snapshot_every = 4;
  // Progress lines (to stderr), so that a run stopped by a time limit shows where it was.
  std::function<void(const std::string&)> note = [](const std::string&) {};
};

// Fills `out` with the figures; returns false (with out["gpu_error"]) when no GPU is usable.
bool RunGpuBench(const GpuBenchOptions& options, nlohmann::ordered_json& out);

}  // namespace ckpt::bench
