// How a copy job is spread over the CUDA engine's streams: regions cut into chunks of at
// most `chunk_bytes`, handed out round-robin so that every stream has work and a large
// tensor's chunks run on all streams at once. Pure, so it is tested without a GPU.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "cuda/copy_engine.h"

namespace ckpt::cuda {

// plan[s] lists stream s's chunks in order. Every byte of every region appears exactly once.
std::vector<std::vector<CopyRegion>> PlanChunks(std::span<const CopyRegion> regions, int streams,
                                                size_t chunk_bytes);

}  // namespace ckpt::cuda
