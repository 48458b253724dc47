#include "daemon/staging/snapshot_layout.h"

#include <catch2/catch.hpp>

#include <vector>

using namespace ckpt::daemon;
using ckpt::format::TensorEntry;

namespace {

std::vector<TensorEntry> Entries(const std::vector<uint64_t>& sizes) {
  std::vector<TensorEntry> out;
  uint64_t at = 0;
  for (uint64_t n : sizes) {
    out.push_back({"t" + std::to_string(out.size()), "U8", {static_cast<int64_t>(n)}, at, at + n});
    at += n;
  }
  return out;
}

}  // namespace

TEST_CASE("a snapshot with nothing frozen is laid out as its data region") {
  const auto entries = Entries({100, 70000, 3});
  const SnapshotLayout l = LayOut(entries, std::vector<EntryPlace>(3, EntryPlace::kOwn));
  CHECK(l.offset == std::vector<uint64_t>{0, 100, 70100});
  CHECK(l.own_bytes == 70103);
  CHECK(l.frozen_bytes == 0);
}

TEST_CASE("large runs start congruent to their place in the region; small ones are packed") {
  // own 100 | frozen 200000 | own 70000 | shared 5000 | own 10 | frozen 50
  const auto entries = Entries({100, 200000, 70000, 5000, 10, 50});
  const std::vector<EntryPlace> places{EntryPlace::kOwn,    EntryPlace::kFrozen, EntryPlace::kOwn,
                                       EntryPlace::kShared, EntryPlace::kOwn,    EntryPlace::kFrozen};
  const SnapshotLayout l = LayOut(entries, places);
  CHECK(l.offset[0] == 0);
  // Each run of 64 KiB or more: at the same offset modulo 4096 as in the region.
  CHECK(l.offset[1] % 4096 == entries[1].begin % 4096);
  CHECK(l.offset[2] % 4096 == entries[2].begin % 4096);
  CHECK(l.offset[2] >= 100);
  // Small runs follow the last byte of their block, unpadded.
  CHECK(l.offset[4] == l.offset[2] + 70000);
  CHECK(l.offset[5] == l.offset[1] + 200000);
  CHECK(l.own_bytes == l.offset[4] + 10);
  CHECK(l.frozen_bytes == l.offset[5] + 50);
  // What the padding costs: under a block per large run.
  CHECK(l.own_bytes < 100 + 70000 + 10 + 4096);
  CHECK(l.frozen_bytes < 200000 + 50 + 4096);
}
