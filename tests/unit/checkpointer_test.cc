// The persist stage with real files, a gate to hold writes, and a ticket sink that records.
#include <catch2/catch.hpp>

#include <cerrno>
#include <condition_variable>
#include <map>
#include <mutex>

#include "cuda/staging_pool.h"
#include "daemon/checkpointer.h"
#include "daemon/persist/verify.h"
#include "tests/fakes/faulty_filesystem.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt;
using namespace ckpt::daemon;
using namespace std::chrono_literals;
using Op = ckpt::testing::FaultyFilesystem::Op;
using ckpt::testing::WaitUntil;

namespace {

class RecordingSink : public TicketSink {
 public:
  void SetTicketState(uint64_t ticket, shm::TicketStateValue state, std::string_view error) override {
    std::lock_guard lock(mu_);
    states_[ticket] = state;
    errors_[ticket] = std::string(error);
    cv_.notify_all();
  }
  shm::TicketStateValue WaitFinal(uint64_t ticket) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, 10s, [&] {
      auto it = states_.find(ticket);
      return it != states_.end() && it->second != shm::kTicketStaged;
    });
    return states_.count(ticket) ? states_[ticket] : shm::kTicketUnknown;
  }
  std::string error(uint64_t ticket) {
    std::lock_guard lock(mu_);
    return errors_[ticket];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, shm::TicketStateValue> states_;
  std::map<uint64_t, std::string> errors_;
};

// Holds every write until Open() so tests can see the state in between.
class GatedWriter : public persist::ShardWriter {
 public:
  explicit GatedWriter(persist::ShardWriter& real) : real_(real) {}
  absl::StatusOr<persist::WrittenShard> Write(const persist::StagedShard& shard,
                                              const std::string& dir) override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] {
      bool held = !held_dir_.empty() && shard.rank == held_rank_ &&
                  dir.find(held_dir_) != std::string::npos;
      return open_ && !held;
    });
    lock.unlock();
    return real_.Write(shard, dir);
  }
  void Open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Holds back only the writes of `rank` into step directories containing `dir_part`.
  void Hold(uint32_t rank, std::string dir_part) {
    std::lock_guard lock(mu_);
    held_rank_ = rank;
    held_dir_ = std::move(dir_part);
  }
  void Release() {
    std::lock_guard lock(mu_);
    held_dir_.clear();
    cv_.notify_all();
  }

 private:
  persist::ShardWriter& real_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  uint32_t held_rank_ = 0;
  std::string held_dir_;
};

struct Fixture {
  testing::TempDir dir;
  std::shared_ptr<testing::FaultyFilesystem> fs =
      std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
  persist::CheckpointStore store{fs, dir.path()};
  persist::ShardWriterPtr real_writer = persist::MakeLocalFsShardWriter(fs);
  GatedWriter writer{*real_writer};
  StatusBoard board;
  cuda::StagingPoolPtr pool = std::move(*cuda::StagingPool::Create(16 << 20, false));
  std::shared_ptr<RecordingSink> sink = std::make_shared<RecordingSink>();
  std::unique_ptr<Checkpointer> checkpointer;
  uint64_t next_ticket = 1;

  explicit Fixture(uint32_t keep_last = 0) {
    Checkpointer::Options options;
    options.retention.keep_last = keep_last;
    options.io_threads = 2;
    checkpointer = std::make_unique<Checkpointer>(store, writer, board, options);
  }

  uint64_t Submit(uint64_t step, uint32_t rank, uint32_t world_size, float value = 1.0f) {
    auto snap = std::make_shared<StagedSnapshot>();
    snap->job = "job";
    snap->step = step;
    snap->rank = rank;
    snap->world_size = world_size;
    snap->block = std::move(*pool->Allocate(64));
    std::fill_n(reinterpret_cast<float*>(snap->block->data()), 16, value);
    snap->shard.rank = rank;
    snap->shard.data = snap->block->data();
    snap->shard.data_bytes = 64;
    snap->shard.entries = {{"w", "F32", {16}, 0, 64}};
    snap->tensor_count = 1;
    snap->placements = {{{16 * world_size}, {16 * rank}}};
    snap->sink = sink;
    snap->ticket = next_ticket++;
    checkpointer->Submit(snap);
    return snap->ticket;
  }
};

}  // namespace

TEST_CASE("a step commits only when every rank is written") {
  Fixture f;
  uint64_t t0 = f.Submit(10, 0, 2);
  f.writer.Open();
  std::this_thread::sleep_for(100ms);
  CHECK(f.store.ListSteps("job")->empty());
  CHECK(f.checkpointer->View()["job"].pending_steps == std::vector<uint64_t>{10});
  uint64_t t1 = f.Submit(10, 1, 2);
  CHECK(f.sink->WaitFinal(t0) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(t1) == shm::kTicketCommitted);
  auto manifest = f.store.LoadManifest("job", 10);
  REQUIRE(manifest.ok());
  CHECK(manifest->world_size == 2);
  CHECK(manifest->tensors.at("w").global_shape == std::vector<int64_t>{32});
  CHECK(manifest->tensors.at("w").shards.size() == 2);
  CHECK(persist::VerifyCheckpoint(f.store, "job", 10)->ok());
  CHECK(f.board.checkpoints_committed == 1);
}

TEST_CASE("one rank's failed write fails the step for every rank and keeps the older one") {
  Fixture f;
  f.writer.Open();
  uint64_t good = f.Submit(10, 0, 1);
  REQUIRE(f.sink->WaitFinal(good) == shm::kTicketCommitted);
  f.fs->FailAfter(Op::kWrite, 1, ENOSPC);
  uint64_t a = f.Submit(20, 0, 1);
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  CHECK(f.sink->error(a).find("No space left") != std::string::npos);
  f.fs->Heal();
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10});
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 20)));
  CHECK(f.board.checkpoints_failed == 1);
  CHECK_FALSE(f.board.RecentErrors().empty());
}

TEST_CASE("a step missing a rank is abandoned when a newer step commits") {
  Fixture f;
  f.writer.Open();
  uint64_t lonely = f.Submit(10, 0, 2);
  uint64_t a = f.Submit(20, 0, 2);
  uint64_t b = f.Submit(20, 1, 2);
  CHECK(f.sink->WaitFinal(a) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(b) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(lonely) == shm::kTicketFailed);
  CHECK(f.sink->error(lonely).find("abandoned") != std::string::npos);
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{20});
}

TEST_CASE("a step whose last rank is still being written is not abandoned by a newer commit") {
  Fixture f;
  // Rank 1's write of step 10 is held while step 20 commits on the other I/O thread.
  f.writer.Hold(1, "step-00000010");
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2);
  uint64_t b = f.Submit(10, 1, 2);
  uint64_t c = f.Submit(20, 0, 2), d = f.Submit(20, 1, 2);
  CHECK(f.sink->WaitFinal(c) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(d) == shm::kTicketCommitted);
  f.writer.Release();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(b) == shm::kTicketCommitted);
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10, 20});
}

TEST_CASE("ranks that disagree on the world size are refused") {
  Fixture f;
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2);
  // The first rank to arrive defines the step's world size.
  const std::string rank0 = f.store.TempStepDir("job", 10) + "/rank-00000.safetensors";
  WaitUntil([&] { return f.fs->Exists(rank0); }, 1s);
  uint64_t b = f.Submit(10, 1, 3);
  CHECK(f.sink->WaitFinal(b) == shm::kTicketFailed);
  CHECK(f.sink->error(b).find("world size") != std::string::npos);
  f.Submit(10, 1, 2);
  CHECK(f.sink->WaitFinal(a) == shm::kTicketCommitted);
}

TEST_CASE("committed snapshots stay in memory for hot restore until evicted") {
  Fixture f;
  f.writer.Open();
  uint64_t t = f.Submit(10, 0, 1);
  REQUIRE(f.sink->WaitFinal(t) == shm::kTicketCommitted);
  CHECK(f.checkpointer->FindHot("job", 0, 10) != nullptr);
  CHECK(f.checkpointer->FindHot("job", 0, 9) == nullptr);
  size_t used = f.pool->used();
  CHECK(f.checkpointer->EvictOneHot());
  // The block returns to the pool once the I/O thread has let go of it too.
  WaitUntil([&] { return f.pool->used() < used; }, 1s);
  CHECK(f.pool->used() < used);
  CHECK(f.checkpointer->FindHot("job", 0, 10) == nullptr);
  CHECK_FALSE(f.checkpointer->EvictOneHot());
}

TEST_CASE("retention runs after each commit and spares pinned steps") {
  Fixture f(2);
  f.writer.Open();
  Checkpointer::Pin pin(f.checkpointer.get(), "job", 10);
  for (uint64_t step : {10, 20, 30, 40}) REQUIRE(f.sink->WaitFinal(f.Submit(step, 0, 1)) == shm::kTicketCommitted);
  // Retention runs right after the commit is announced, off the trainer's path.
  std::vector<uint64_t> expected = {10, 30, 40};
  WaitUntil([&] { return *f.store.ListSteps("job") == expected; }, 1s);
  CHECK(*f.store.ListSteps("job") == expected);
}

TEST_CASE("shutdown fails what it cannot finish and leaves no unfinished directory") {
  Fixture f;
  uint64_t a = f.Submit(10, 0, 2);  // rank 1 never arrives
  std::thread opener([&] {
    std::this_thread::sleep_for(50ms);
    f.writer.Open();
  });
  f.checkpointer->Shutdown(2s);
  opener.join();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  CHECK(f.sink->error(a).find("shut down") != std::string::npos);
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 10)));
  uint64_t late = f.Submit(20, 0, 1);
  CHECK(f.sink->WaitFinal(late) == shm::kTicketFailed);
}
