// The incremental writer against the stager's promise that a snapshot's last byte lands only
// once the trainer is released: a snapshot the trainer abandoned during the copy is never
// written whole, even when its last entries (frozen tensors shared from an earlier snapshot)
// are never waited for on their own.
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "daemon/persist/increment_bases.h"
#include "daemon/persist/increment_writer.h"
#include "daemon/persist/retention_keeper.h"
#include "format/checkpoint_store.h"
#include "storage/filesystem.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;

TEST_CASE("a streamed save whose last entries are shared frozen ones waits for the last byte") {
  testing::TempDir dir;
  auto fs = MakePosixFilesystem();
  format::CheckpointStore store(fs, dir.path() + "/root");
  REQUIRE(fs->MakeDir(store.root()).ok());
  persist::RetentionKeeper retention(store, {0, 0}, [](const std::string&, uint64_t) {}, [](const std::string&) {});
  persist::IncrementBases bases;
  persist::IncrementWriter writer(store, bases, retention, {});

  // "own" from the trainer, then "base", frozen and shared: in a place of its own.
  const std::string own(4096, 'o'), base(4096, 'b');
  daemon::StagedSnapshot snap;
  snap.job = "j";
  snap.step = 1;
  snap.world_size = 1;
  snap.tensor_count = 2;
  snap.shard.entries = {{"own", "U8", {4096}, 0, 4096}, {"base", "U8", {4096}, 4096, 8192}};
  snap.placements.resize(2);
  snap.frozen.resize(2);
  snap.frozen[1] = {true, true, 0, 1};
  snap.frozen_sums = std::make_shared<daemon::FrozenSums>();
  snap.shard.region.Append(own.data(), own.size());
  snap.shard.region.Append(base.data(), base.size());
  snap.shard.data_bytes = 8192;
  snap.shard.landed = &snap.landed;
  // All but the last byte, as the stager holds it back until the trainer is released; then
  // the trainer turns out to have stopped waiting.
  snap.landed.Advance(8191);
  std::thread abandon([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    snap.landed.Fail("the trainer stopped waiting for it");
  });
  REQUIRE(store.BeginStep("j", 1).ok());
  absl::StatusOr<persist::WrittenShard> written = writer.Write(snap, store.TempStepKey("j", 1));
  abandon.join();
  REQUIRE_FALSE(written.ok());
  CHECK(Message(written.status()).find("the trainer stopped waiting") != std::string::npos);
}
