// Frozen tensors (issue 48, item 2): the stager copies a frozen tensor from the trainer once,
// into a frozen block that later snapshots share (the same bytes at the same address, its
// memory paid once); every --frozen-check-every-th snapshot copies and compares it again,
// into a new block; a thaw, a restore, a buffer registered anew or every snapshot holding the
// block gone make the next snapshot copy it. The copy engine records each region, so "not
// copied from the trainer" is what the test sees, and the pool's use what memory costs.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda/copy_engine.h"
#include "cuda/staging_pool.h"
#include "daemon/staging/frozen_tensors.h"
#include "daemon/staging/hot_cache.h"
#include "daemon/staging/stager.h"

using namespace ckpt;
using namespace ckpt::daemon;

namespace {

// The host engine, recording the source of every region it copies.
class RecordingEngine : public cuda::CopyEngine {
 public:
  std::string_view name() const override { return "recording"; }
  absl::Status Copy(std::span<const cuda::CopyRegion> regions, void*) override {
    {
      std::lock_guard lock(mu_);
      for (const cuda::CopyRegion& r : regions) sources_.insert(r.src);
    }
    return real_->Copy(regions);
  }
  bool Copied(const void* src) {
    std::lock_guard lock(mu_);
    return sources_.count(src) != 0;
  }
  void Forget() {
    std::lock_guard lock(mu_);
    sources_.clear();
  }

 private:
  std::mutex mu_;
  std::set<const void*> sources_;
  cuda::CopyEnginePtr real_ = cuda::MakeHostCopyEngine(2);
};

struct Fixture {
  explicit Fixture(uint32_t check_every, size_t pool_bytes = 1 << 20) : frozen(check_every) {
    pool = std::move(*cuda::StagingPool::Create(pool_bytes, false));
    for (size_t size : {40000, 3000}) {
      buffers.emplace_back(size, 'a');
      RegisteredTensor t;
      t.name = "t" + std::to_string(tensors.size());
      t.dtype = "U8";
      t.shape = {static_cast<int64_t>(size)};
      t.nbytes = size;
      t.data = buffers.back().data();
      tensors.push_back(std::move(t));
    }
    tensors[0].frozen = true;  // "the base": 40000 bytes
    frozen.Registered(tensors, {});
  }

  // One snapshot as a session takes it: planned, staged, then kept as the daemon's hot cache
  // keeps a rank's newest committed snapshot (and with it the frozen block it holds).
  StagedSnapshotPtr Snapshot(uint64_t step) {
    engine.Forget();
    Stager stager(*pool, engine, hot, progress, {});
    SessionView view{"job", 0, 0, 1, &tensors, nullptr, nullptr, &frozen};
    auto staged = stager.Stage(view, step, {});
    REQUIRE(staged.ok());
    frozen.Staged(**staged);
    kept = *staged;
    return *staged;
  }
  std::string Bytes(const StagedSnapshotPtr& snap, size_t i) {
    const format::TensorEntry& e = snap->shard.entries[i];
    return std::string(snap->shard.Data(e), e.end - e.begin);
  }
  bool CopiedFromTrainer(size_t i) { return engine.Copied(buffers[i].data()); }
  const FrozenBlock* BlockOf(const StagedSnapshotPtr& snap, size_t i) {
    const int b = snap->frozen[i].block;
    return b < 0 ? nullptr : snap->frozen_blocks[static_cast<size_t>(b)].get();
  }

  ProgressSignal progress;
  HotCache hot{progress};
  cuda::StagingPoolPtr pool;
  RecordingEngine engine;
  FrozenTensors frozen;
  StagedSnapshotPtr kept;
  std::vector<std::string> buffers;
  std::vector<RegisteredTensor> tensors;
};

}  // namespace

TEST_CASE("a frozen tensor is copied from the trainer once, into a frozen block later snapshots share") {
  Fixture f(/*check_every=*/0);
  StagedSnapshotPtr first = f.Snapshot(1);
  CHECK(f.CopiedFromTrainer(0));
  CHECK(f.CopiedFromTrainer(1));
  REQUIRE(first->frozen.size() == 2);
  CHECK(first->frozen[0].frozen);
  CHECK_FALSE(first->frozen[0].shared);
  CHECK(first->frozen[0].generation != 0);
  CHECK(first->frozen[1].generation == 0);  // not frozen
  CHECK(first->frozen[1].block == -1);
  CHECK(first->shared_bytes == 0);
  REQUIRE(f.BlockOf(first, 0) != nullptr);
  // The frozen tensor in a block of its own (10 pages), the rest in the snapshot's (1 page).
  CHECK(first->block->size() == 4096);
  CHECK(f.BlockOf(first, 0)->block->size() == 40960);
  const char* base = first->shard.Data(first->shard.entries[0]);

  std::vector<StagedSnapshotPtr> in_flight{first};
  for (uint64_t step = 2; step <= 4; ++step) {
    f.buffers[1].assign(f.buffers[1].size(), static_cast<char>('a' + step));  // trained
    StagedSnapshotPtr next = f.Snapshot(step);
    in_flight.push_back(next);
    CHECK_FALSE(f.CopiedFromTrainer(0));
    CHECK(f.CopiedFromTrainer(1));
    CHECK(next->frozen[0].shared);
    CHECK(next->frozen[0].generation == first->frozen[0].generation);
    CHECK(next->shared_bytes == 40000);
    // The same bytes, where the first snapshot staged them: shared, not copied.
    CHECK(next->shard.Data(next->shard.entries[0]) == base);
    CHECK(f.BlockOf(next, 0) == f.BlockOf(first, 0));
    CHECK(f.Bytes(next, 0) == f.buffers[0]);
    CHECK(f.Bytes(next, 1) == f.buffers[1]);
    CHECK(next->landed.WaitFor(next->shard.data_bytes).ok());
  }
  // Four snapshots alive at once hold the frozen tensor once: its block and four pages.
  CHECK(f.pool->used() == 40960 + 4 * 4096);
}

TEST_CASE("a frozen block lives while any snapshot holds it, and goes with the last") {
  Fixture f(/*check_every=*/0);
  StagedSnapshotPtr first = f.Snapshot(1);
  StagedSnapshotPtr second = f.Snapshot(2);
  CHECK(second->frozen[0].shared);
  // The snapshot that staged the block is written and evicted; the block stays with the one
  // that shares it, and the next snapshot shares it too.
  first.reset();
  f.kept = second;
  CHECK(f.pool->used() == 40960 + 4096);
  StagedSnapshotPtr third = f.Snapshot(3);
  CHECK_FALSE(f.CopiedFromTrainer(0));
  CHECK(f.Bytes(third, 0) == f.buffers[0]);
  second.reset();
  third.reset();
  f.kept.reset();
  CHECK(f.pool->used() == 0);
}

TEST_CASE("every Nth snapshot checks frozen tensors and saves one changed in place") {
  Fixture f(/*check_every=*/3);
  StagedSnapshotPtr first = f.Snapshot(1);  // copied: the first
  const uint64_t generation = first->frozen[0].generation;
  f.buffers[0][123] = 'Z';  // user code changed a "frozen" tensor in place
  StagedSnapshotPtr second = f.Snapshot(2);
  StagedSnapshotPtr third = f.Snapshot(3);
  // Between checks a snapshot has the bytes last seen: the window --frozen-check-every allows.
  CHECK_FALSE(f.CopiedFromTrainer(0));
  CHECK(f.Bytes(third, 0)[123] == 'a');
  StagedSnapshotPtr check = f.Snapshot(4);  // two shares since the first: the third is due
  CHECK(f.CopiedFromTrainer(0));
  CHECK_FALSE(check->frozen[0].shared);
  CHECK(f.BlockOf(check, 0) != f.BlockOf(first, 0));  // into a new block, the next ones' source
  CHECK(f.Bytes(check, 0) == f.buffers[0]);
  CHECK(check->frozen_changed == std::vector<std::string>{"t0"});
  CHECK(check->frozen[0].generation != generation);
  // Changed in place once, it is not trusted again: copied at every snapshot...
  f.buffers[0][7] = 'Y';
  StagedSnapshotPtr copied = f.Snapshot(5);
  CHECK(f.CopiedFromTrainer(0));
  CHECK(f.Bytes(copied, 0) == f.buffers[0]);
  // ...until it is frozen anew (the Python client does so when it sees the change).
  f.frozen.Registered(f.tensors, {"t0"});
  StagedSnapshotPtr again = f.Snapshot(6);
  CHECK(f.CopiedFromTrainer(0));
  StagedSnapshotPtr shared = f.Snapshot(7);
  CHECK_FALSE(f.CopiedFromTrainer(0));
  CHECK(shared->frozen[0].generation == again->frozen[0].generation);
  // A check that finds nothing keeps the generation (and so the known checksums).
  f.Snapshot(8);
  StagedSnapshotPtr quiet = f.Snapshot(9);
  CHECK(f.CopiedFromTrainer(0));
  CHECK(quiet->frozen_changed.empty());
  CHECK(quiet->frozen[0].generation == again->frozen[0].generation);
}

TEST_CASE("a restore, a buffer registered anew, a thaw or a lost snapshot makes the next one copy") {
  Fixture f(/*check_every=*/0);
  StagedSnapshotPtr last = f.Snapshot(1);
  uint64_t generation = last->frozen[0].generation;
  auto copied_anew = [&](uint64_t step) {
    last = f.Snapshot(step);
    const bool anew = f.CopiedFromTrainer(0) && last->frozen[0].generation != generation;
    generation = last->frozen[0].generation;
    return anew;
  };

  SECTION("a restore wrote the trainer's tensors") {
    f.frozen.Invalidate();
    CHECK(copied_anew(2));
    CHECK_FALSE(copied_anew(3));
  }
  SECTION("an update gave the tensor a new buffer") {
    f.frozen.Registered(f.tensors, {"t0"});
    CHECK(copied_anew(2));
  }
  SECTION("thawed, it is copied at every snapshot; frozen again, once more") {
    f.tensors[0].frozen = false;
    f.frozen.Registered(f.tensors, {});
    last = f.Snapshot(2);
    CHECK(f.CopiedFromTrainer(0));
    CHECK(last->frozen.empty());  // no tensor is frozen now
    f.Snapshot(3);
    CHECK(f.CopiedFromTrainer(0));
    f.tensors[0].frozen = true;
    f.frozen.Registered(f.tensors, {});
    CHECK(copied_anew(4));
    CHECK_FALSE(copied_anew(5));
  }
  SECTION("every snapshot holding its block is gone (written and evicted)") {
    last.reset();
    f.kept.reset();
    CHECK(copied_anew(2));
  }
}

TEST_CASE("when staging memory is short the hot copy is evicted, and its frozen block still shared") {
  // Room for one snapshot's two blocks (11 pages) and nothing more.
  Fixture f(/*check_every=*/0, /*pool_bytes=*/44 << 10);
  StagedSnapshotPtr first = f.Snapshot(1);
  f.hot.Insert({first});  // committed: the hot copy, as the daemon keeps it
  const std::string base = f.buffers[0];
  first.reset();
  f.kept.reset();
  // The next snapshot's page is the hot copy's own: evicted for it. Its frozen block, which the
  // snapshot shares, stays.
  StagedSnapshotPtr second = f.Snapshot(2);
  CHECK_FALSE(f.CopiedFromTrainer(0));
  CHECK(second->frozen[0].shared);
  CHECK(f.Bytes(second, 0) == base);
  CHECK(f.pool->used() == 44 << 10);
}

TEST_CASE("a check that finds no room for a second copy of the frozen tensors is put off, and runs once there is") {
  Fixture f(/*check_every=*/2, /*pool_bytes=*/96 << 10);
  StagedSnapshotPtr first = f.Snapshot(1);
  StagedSnapshotPtr second = f.Snapshot(2);  // shares: the next one is a check
  CHECK(second->frozen[0].shared);
  first.reset();
  // Other snapshots hold the rest of the pool: room for a snapshot's own block, not for a
  // second copy of the frozen tensors.
  auto others = std::move(*f.pool->Allocate(f.pool->capacity() - f.pool->used() - 8192));
  StagedSnapshotPtr put_off = f.Snapshot(3);
  CHECK_FALSE(f.CopiedFromTrainer(0));
  CHECK(f.CopiedFromTrainer(1));
  CHECK(put_off->frozen[0].shared);
  CHECK(f.Bytes(put_off, 0) == f.buffers[0]);
  second.reset();
  others.reset();
  StagedSnapshotPtr check = f.Snapshot(4);  // room now: the check runs
  CHECK(f.CopiedFromTrainer(0));
  CHECK_FALSE(check->frozen[0].shared);
  CHECK(f.BlockOf(check, 0) != f.BlockOf(put_off, 0));
  CHECK(f.Bytes(check, 0) == f.buffers[0]);
}

TEST_CASE("a check put off three times in a row makes room as a snapshot does, and is put off only without any") {
  // Room for the frozen block (10 pages) and two own blocks, never for a second frozen block.
  Fixture f(/*check_every=*/2, /*pool_bytes=*/48 << 10);
  StagedSnapshotPtr first = f.Snapshot(1);
  StagedSnapshotPtr second = f.Snapshot(2);
  first.reset();
  for (uint64_t step = 3; step <= 7; ++step) {
    // Each after the third makes room first: it evicts the hot copy (its own block; the
    // frozen block it shares stays), then finds none all the same.
    f.hot.Insert({second});
    StagedSnapshotPtr put_off = f.Snapshot(step);
    INFO("step " << step);
    CHECK_FALSE(f.CopiedFromTrainer(0));
    CHECK(put_off->frozen[0].shared);
    CHECK(put_off->frozen_changed.empty());
    CHECK(f.Bytes(put_off, 0) == f.buffers[0]);
    CHECK(static_cast<bool>(f.hot.Find("job", 0, step - 1)) == (step <= 5));
    second = put_off;
  }
}
