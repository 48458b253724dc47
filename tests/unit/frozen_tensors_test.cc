// Frozen tensors (issue 48, item 2): the stager copies a frozen tensor from the trainer once,
// then fills it from the session's previous snapshot after the trainer is released; every
// --frozen-check-every-th snapshot copies and compares it again; a thaw, a restore, a buffer
// registered anew or a previous snapshot gone make the next snapshot copy it. The copy
// engine records each region, so "not copied from the trainer" is what the test sees.
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

  // One snapshot as a session takes it: planned, staged, then the next one's source, kept
  // as the daemon's hot cache keeps a rank's newest committed snapshot.
  // With `fill_later`, the fill is left to the caller (Stager::Stage's FillLater).
  StagedSnapshotPtr Snapshot(uint64_t step, Stager::FillLater* fill_later = nullptr) {
    engine.Forget();
    Stager stager(*pool, engine, hot, progress, {});
    SessionView view{"job", 0, 0, 1, &tensors, nullptr, nullptr, &frozen};
    auto staged = stager.Stage(view, step, {}, {}, {}, fill_later);
    REQUIRE(staged.ok());
    frozen.Staged(*staged);
    kept = *staged;
    return *staged;
  }
  std::string Bytes(const StagedSnapshotPtr& snap, size_t i) {
    const format::TensorEntry& e = snap->shard.entries[i];
    return std::string(snap->shard.Data(e), e.end - e.begin);
  }
  bool CopiedFromTrainer(size_t i) { return engine.Copied(buffers[i].data()); }

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

TEST_CASE("a frozen tensor is copied from the trainer once, then filled from the last snapshot") {
  Fixture f(/*check_every=*/0);
  StagedSnapshotPtr first = f.Snapshot(1);
  CHECK(f.CopiedFromTrainer(0));
  CHECK(f.CopiedFromTrainer(1));
  REQUIRE(first->frozen.size() == 2);
  CHECK(first->frozen[0].frozen);
  CHECK_FALSE(first->frozen[0].filled);
  CHECK(first->frozen[0].generation != 0);
  CHECK(first->frozen[1].generation == 0);  // not frozen
  CHECK(first->filled_bytes == 0);

  for (uint64_t step = 2; step <= 4; ++step) {
    f.buffers[1].assign(f.buffers[1].size(), static_cast<char>('a' + step));  // trained
    StagedSnapshotPtr next = f.Snapshot(step);
    CHECK_FALSE(f.CopiedFromTrainer(0));
    CHECK(f.CopiedFromTrainer(1));
    CHECK(next->frozen[0].filled);
    CHECK(next->frozen[0].generation == first->frozen[0].generation);
    CHECK(next->filled_bytes == 40000);
    CHECK(f.Bytes(next, 0) == f.buffers[0]);
    CHECK(f.Bytes(next, 1) == f.buffers[1]);
    // The trainer's bytes come first; the filled ones after its release.
    CHECK(next->filled_from == next->shard.entries[0].begin);
    CHECK(next->own_landed.WaitFor(1).ok());
    CHECK(next->landed.WaitFor(next->shard.data_bytes).ok());
  }
}

TEST_CASE("a fill left for later: the trainer's bytes land first, the frozen ones when the session runs the fill") {
  Fixture f(/*check_every=*/0);
  Stager::FillLater fill;
  StagedSnapshotPtr first = f.Snapshot(1, &fill);
  CHECK_FALSE(fill);  // nothing to fill: copied from the trainer, landed whole
  CHECK(first->landed.WaitFor(first->shard.data_bytes).ok());

  f.buffers[1].assign(f.buffers[1].size(), 'z');
  StagedSnapshotPtr next = f.Snapshot(2, &fill);
  REQUIRE(fill);
  CHECK(next->own_landed.WaitFor(1).ok());
  CHECK(f.Bytes(next, 1) == f.buffers[1]);
  std::atomic<bool> landed{false};
  std::thread reader([&] {
    CHECK(next->landed.WaitFor(next->shard.data_bytes).ok());
    landed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(landed);  // a reader of the whole snapshot waits for the fill
  // The fill reads the previous snapshot, not the trainer's memory, which may change now.
  f.buffers[0].assign(f.buffers[0].size(), 'q');
  fill();
  reader.join();
  CHECK(landed);
  CHECK(f.Bytes(next, 0) == std::string(40000, 'a'));
  CHECK(next->frozen[0].filled);
  CHECK(next->frozen[0].generation == first->frozen[0].generation);
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
  StagedSnapshotPtr check = f.Snapshot(4);  // two fills since the first: the third is due
  CHECK(f.CopiedFromTrainer(0));
  CHECK_FALSE(check->frozen[0].filled);
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
  StagedSnapshotPtr filled = f.Snapshot(7);
  CHECK_FALSE(f.CopiedFromTrainer(0));
  CHECK(filled->frozen[0].generation == again->frozen[0].generation);
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
  SECTION("the previous snapshot is gone (written and evicted)") {
    last.reset();
    f.kept.reset();
    CHECK(copied_anew(2));
  }
}

TEST_CASE("when staging memory is short the frozen source is given up, not the snapshot") {
  // Room for one snapshot (43000 bytes, page-aligned blocks) but not two.
  Fixture f(/*check_every=*/0, /*pool_bytes=*/48 << 10);
  StagedSnapshotPtr first = f.Snapshot(1);
  f.hot.Insert({first});  // committed: the hot copy, as the daemon keeps it
  const std::string base = f.buffers[0];
  first.reset();
  f.kept.reset();
  StagedSnapshotPtr second = f.Snapshot(2);
  CHECK(f.CopiedFromTrainer(0));
  CHECK_FALSE(second->frozen[0].filled);
  CHECK(f.Bytes(second, 0) == base);
}
