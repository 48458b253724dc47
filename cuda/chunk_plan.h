// How a copy job is spread over the CUDA engine's streams: regions cut into chunks of at
// most `chunk_bytes`, handed out round-robin so that every stream has work and a large
// tensor's chunks run on all streams at once. Pure, so it is tested without a GPU.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "cuda/copy_engine.h"

namespace ckpt::cuda {

// Regions of one device allocation (CopyRegion::allocation) that continue the previous one
// on both sides (source and destination adjacent), as one region; empty regions dropped.
// Measured on an H200: 10,000 buffers of 430 KB, copied one call each, restored at 28% of
// the pinned limit, the per-call cost dominating.
std::vector<CopyRegion> CoalesceRegions(std::span<const CopyRegion> regions);

// plan[s] lists stream s's chunks in order. Every byte of every region appears exactly once;
// adjacent regions are copied as one (CoalesceRegions).
std::vector<std::vector<CopyRegion>> PlanChunks(std::span<const CopyRegion> regions, int streams,
                                                size_t chunk_bytes);

}  // namespace ckpt::cuda
