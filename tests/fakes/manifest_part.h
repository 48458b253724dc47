// One node's manifest part for group tests: shards of `ranks`, each holding its 16-element
// row of tensor "w" (F32, 16 x world_size in all), as commit_test's snapshots place it.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <vector>

#include "format/manifest.h"

namespace ckpt::testing {

inline format::Manifest ManifestPart(const std::string& job, uint64_t step, uint32_t world_size,
                                      std::vector<uint32_t> ranks) {
  format::Manifest m;
  m.job = job;
  m.step = step;
  m.world_size = world_size;
  m.ckptd_version = "test";
  m.wall_time = "2024-01-01T00:00:00Z";
  m.checksum_chunk_bytes = format::kChecksumChunkBytes;  // as every ckptd's parts say
  for (uint32_t r : ranks) {
    format::ManifestShard s;
    s.rank = r;
    s.file = fmt::format("rank-{:05d}.safetensors", r);
    s.bytes = 1000 + r;
    format::ManifestTensor& w = m.tensors["w"];
    w.dtype = "F32";
    w.global_shape = {16 * static_cast<int64_t>(world_size)};
    w.shards.push_back({r, s.file, 0, 64, {16 * static_cast<int64_t>(r)}, {16}, "", {}, {}});
    m.shards.push_back(std::move(s));
  }
  return m;
}

}  // namespace ckpt::testing
