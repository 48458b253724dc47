// A committed step of 4 ranks on two nodes (node 0: ranks 0 and 3; node 1: ranks 1 and 2),
// each rank holding one row of "w" [4, 2]: the whole manifest the format tests cut into
// node-scoped manifests and indexes.
#pragma once

#include <cstdint>

#include "format/manifest.h"

namespace ckpt::testing {

inline format::Manifest FourRankStep() {
  format::Manifest m;
  m.job = "llm";
  m.step = 1200;
  m.unix_time = 1.5e9;
  m.wall_time = "2026-11-22T06:00:00Z";
  m.world_size = 4;
  m.ckptd_version = "0.1.0";
  m.run = 7;
  m.metadata = {{"loss", "1.5"}};
  for (uint32_t r = 0; r < 4; ++r) {
    m.shards.push_back({r, format::ShardFileName(r), 100 + r, {}, {}});
    m.tensors["w"].dtype = "F32";
    m.tensors["w"].global_shape = {4, 2};
    m.tensors["w"].shards.push_back(
        {r, format::ShardFileName(r), 0, 8, {int64_t{r}, 0}, {1, 2}, "xxh3:0000000000000001", {}, {}});
  }
  m.nodes = {{0, {0, 3}}, {1, {1, 2}}};
  return m;
}

}  // namespace ckpt::testing
