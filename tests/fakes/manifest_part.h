// One node's manifest part for group tests: shards of `ranks` only, no tensors.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/persist/manifest.h"

namespace ckpt::testing {

inline persist::Manifest ManifestPart(const std::string& job, uint64_t step, uint32_t world_size,
                                      std::vector<uint32_t> ranks) {
  persist::Manifest m;
  m.job = job;
  m.step = step;
  m.world_size = world_size;
  m.ckptd_version = "test";
  m.wall_time = "2024-01-01T00:00:00Z";
  for (uint32_t r : ranks) {
    persist::ManifestShard s;
    s.rank = r;
    s.file = fmt::format("rank-{:05d}.safetensors", r);
    s.bytes = 1000 + r;
    m.shards.push_back(std::move(s));
  }
  return m;
}

}  // namespace ckpt::testing
