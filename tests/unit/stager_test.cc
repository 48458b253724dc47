// The stager copies a session's buffers in chunks, in order, handing the snapshot to the
// persist stage before the first byte: the real write queue writes while it copies, and the
// committed shard holds exactly the registered bytes. GPU tensors are stood in for by host
// memory marked as device 0, copied by a recording twin of the device engine.
#include <catch2/catch.hpp>

#include <mutex>
#include <numeric>

#include "cuda/staging_pool.h"
#include "daemon/commit/single_node_committer.h"
#include "daemon/persist/retention_keeper.h"
#include "format/verify.h"
#include "daemon/persist/write_queue.h"
#include "storage/local_store.h"
#include "daemon/staging/hot_cache.h"
#include "daemon/staging/stager.h"
#include "tests/fakes/faulty_filesystem.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt;
using namespace ckpt::daemon;
using namespace std::chrono_literals;

namespace {

// Forwards to the host engine and records what each call copied; can fail the n-th call.
class RecordingEngine : public cuda::CopyEngine {
 public:
  std::string_view name() const override { return "recording"; }
  absl::Status Copy(std::span<const cuda::CopyRegion> regions, void* after) override {
    std::lock_guard lock(mu_);
    if (++calls_ == fail_call_) return absl::InternalError("copy engine fault injected");
    calls.emplace_back(regions.begin(), regions.end());
    return real_->Copy(regions, after);
  }
  void FailCall(int n) { fail_call_ = n; }
  std::vector<std::vector<cuda::CopyRegion>> calls;

 private:
  std::mutex mu_;
  cuda::CopyEnginePtr real_ = cuda::MakeHostCopyEngine(2);
  int calls_ = 0;
  int fail_call_ = 0;
};

class LastStateSink : public TicketSink {
 public:
  void SetTicketState(uint64_t, shm::TicketStateValue s, std::string_view error) override {
    std::lock_guard lock(mu_);
    if (state == shm::kTicketUnknown || state == shm::kTicketStaged) {
      state = s;
      this->error = error;
    }
  }
  shm::TicketStateValue Get() {
    std::lock_guard lock(mu_);
    return state;
  }
  std::mutex mu_;
  shm::TicketStateValue state = shm::kTicketUnknown;
  std::string error;
};

struct Fixture {
  testing::TempDir dir;
  FilesystemPtr fs = MakePosixFilesystem();
  format::CheckpointStore store{fs, dir.path()};
  persist::ShardWriterPtr writer = persist::MakeShardWriter(store.objects_ptr());
  cuda::StagingPoolPtr pool = std::move(*cuda::StagingPool::Create(4 << 20, false));
  ProgressSignal progress;
  HotCache hot{progress};
  commit::SingleNodeCommitter committer{store, Hooks(), {}};
  persist::WriteQueue writes{*writer, committer, progress, {2}};
  RecordingEngine engine;  // device 0's engine
  cuda::CopyEnginePtr host_engine = cuda::MakeHostCopyEngine(2);
  std::shared_ptr<LastStateSink> sink = std::make_shared<LastStateSink>();

  commit::CommitHooks Hooks() {
    commit::CommitHooks hooks;
    hooks.committed = [this](const format::Manifest&, const std::vector<StagedSnapshotPtr>& local) {
      hot.Insert(local);
    };
    return hooks;
  }

  // Odd sizes, an empty tensor, and tensors larger than a chunk.
  std::vector<std::vector<char>> buffers;
  std::vector<RegisteredTensor> tensors;
  Fixture() {
    for (size_t size : {10000, 1, 70000, 0, 4096, 33333}) {
      std::vector<char> b(size);
      for (size_t i = 0; i < size; ++i) b[i] = static_cast<char>(i * 31 + size);
      buffers.push_back(std::move(b));
      RegisteredTensor t;
      t.name = "t" + std::to_string(tensors.size());
      t.dtype = "U8";
      t.shape = {static_cast<int64_t>(size)};
      t.nbytes = size;
      t.data = buffers.back().data();
      t.on_device = true;
      t.device = 0;
      tensors.push_back(std::move(t));
    }
  }

  absl::StatusOr<StagedSnapshotPtr> Stage(uint64_t step, uint64_t chunk_bytes) {
    Stager::Options options;
    options.chunk_bytes = chunk_bytes;
    Stager stager(*pool, *host_engine, hot, progress, options, nullptr, {&engine});
    SessionView view{"job", 0, 0, 1, &tensors, nullptr};
    shm::SnapshotPayload payload;
    payload.train_state.push_back({"step", std::string(8, '\x07')});
    return stager.Stage(view, step, std::move(payload), [&](const StagedSnapshotPtr& snap) {
      CHECK(snap->shard.landed == &snap->landed);
      snap->sink = sink;
      snap->ticket = 1;
      writes.Submit(snap);
    });
  }
};

}  // namespace

TEST_CASE("staging copies chunk by chunk, in order, and the committed shard is exact") {
  Fixture f;
  constexpr uint64_t kChunk = 16384;
  auto staged = f.Stage(10, kChunk);
  REQUIRE(staged.ok());
  const uint64_t tensor_bytes = 10000 + 1 + 70000 + 0 + 4096 + 33333;
  // Each call fills exactly the next chunk of the data region.
  REQUIRE(f.engine.calls.size() == (tensor_bytes + kChunk - 1) / kChunk);
  char* base = (*staged)->block->data();
  for (size_t c = 0; c < f.engine.calls.size(); ++c) {
    uint64_t expect = c * kChunk;
    for (const cuda::CopyRegion& r : f.engine.calls[c]) {
      CHECK(static_cast<char*>(r.dst) - base == static_cast<int64_t>(expect));
      expect += r.bytes;
    }
    CHECK(expect == std::min(tensor_bytes, (c + 1) * kChunk));
  }
  REQUIRE(ckpt::testing::WaitUntil([&] { return f.sink->Get() == shm::kTicketCommitted; }, 10s));
  auto report = format::VerifyCheckpoint(f.store, "job", 10);
  REQUIRE(report.ok());
  CHECK(report->ok());
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    const format::TensorEntry& e = (*staged)->shard.entries[i];
    CHECK(std::string(base + e.begin, e.end - e.begin) ==
          std::string(f.buffers[i].begin(), f.buffers[i].end()));
  }
}

TEST_CASE("a copy error mid-snapshot fails the ticket and leaves no step behind") {
  Fixture f;
  f.engine.FailCall(3);
  auto staged = f.Stage(20, 16384);
  REQUIRE(!staged.ok());
  CHECK_THAT(Message(staged.status()),
             Catch::Contains("[job/r0 s20] snapshot") && Catch::Contains("copy engine fault injected"));
  REQUIRE(ckpt::testing::WaitUntil([&] { return f.sink->Get() == shm::kTicketFailed; }, 10s));
  CHECK_THAT(f.sink->error, Catch::Contains("staging copy failed"));
  CHECK(ckpt::testing::WaitUntil([&] { return !f.fs->Exists(f.store.TempStepDir("job", 20)); }, 10s));
  CHECK(!f.fs->Exists(f.store.StepDir("job", 20)));
  // Staging memory went back to the pool: the next snapshot stages and commits.
  f.engine.FailCall(0);
  f.sink->state = shm::kTicketUnknown;
  REQUIRE(f.Stage(30, 1 << 20).ok());
  CHECK(ckpt::testing::WaitUntil([&] { return f.sink->Get() == shm::kTicketCommitted; }, 10s));
}

TEST_CASE("host tensors are copied as one job: the writer could not overlap them anyway") {
  Fixture f;
  for (RegisteredTensor& t : f.tensors) t.on_device = false;
  Stager::Options options;
  options.chunk_bytes = 16384;
  Stager stager(*f.pool, f.engine, f.hot, f.progress, options);
  SessionView view{"job", 0, 0, 1, &f.tensors, nullptr};
  auto staged = stager.Stage(view, 40, {});
  REQUIRE(staged.ok());
  CHECK(f.engine.calls.size() == 1);
  const format::TensorEntry& last = (*staged)->shard.entries.back();
  CHECK(std::string((*staged)->block->data() + last.begin, last.end - last.begin) ==
        std::string(f.buffers.back().begin(), f.buffers.back().end()));
}

TEST_CASE("a snapshot is checked whole before anything is staged") {
  Fixture f;
  for (RegisteredTensor& t : f.tensors) t.on_device = false;
  Stager stager(*f.pool, *f.host_engine, f.hot, f.progress, {});
  SessionView view{"job", 0, 0, 1, &f.tensors, nullptr};
  auto refused = [&](uint64_t step, shm::SnapshotPayload payload, const std::string& why) {
    bool laid_out = false;
    auto staged = stager.Stage(view, step, std::move(payload),
                               [&](const StagedSnapshotPtr&) { laid_out = true; });
    REQUIRE_FALSE(staged.ok());
    CHECK_THAT(Message(staged.status()), Catch::Contains(why));
    CHECK_FALSE(laid_out);
    CHECK(f.pool->used() == 0);
  };
  refused(format::kMaxStep + 1, {}, "beyond the largest step");
  shm::SnapshotPayload twice;
  twice.train_state = {{"rng", "a"}, {"rng", "b"}};
  refused(1, std::move(twice), "given twice");
  shm::SnapshotPayload not_text;
  not_text.metadata["loss"] = "\xff";
  refused(1, std::move(not_text), "not valid UTF-8");
  CHECK(stager.Stage(view, format::kMaxStep, {}, nullptr).ok());
}
