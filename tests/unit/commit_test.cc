// The persist and commit stages together with real files: the write queue, a committer
// (single node, or group with an in-process coordinator over loopback gRPC), the hot
// cache and retention. One suite runs over both committers; cases that only one of them
// has follow.
#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>

#include "cuda/staging_pool.h"
#include "tests/fakes/manifest_part.h"
#include "daemon/commit/group_committer.h"
#include "daemon/commit/single_node_committer.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/group_client.h"
#include "daemon/group/group_server.h"
#include "daemon/persist/retention_keeper.h"
#include "format/verify.h"
#include "daemon/persist/write_queue.h"
#include "storage/local_store.h"
#include "daemon/staging/hot_cache.h"
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
  shm::TicketStateValue WaitFinal(uint64_t ticket, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout, [&] {
      auto it = states_.find(ticket);
      return it != states_.end() && it->second != shm::kTicketStaged;
    });
    return states_.count(ticket) ? states_[ticket] : shm::kTicketUnknown;
  }
  std::string error(uint64_t ticket) {
    std::lock_guard lock(mu_);
    return errors_[ticket];
  }
  bool told(uint64_t ticket) {
    std::lock_guard lock(mu_);
    return states_.count(ticket) > 0;
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
  absl::StatusOr<persist::WrittenShard> Write(const StagedShard& shard,
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

// Everything below the stager, as server.cc wires it, minus the committer.
struct Stages {
  testing::TempDir dir;
  std::shared_ptr<testing::FaultyFilesystem> fs =
      std::make_shared<testing::FaultyFilesystem>(MakePosixFilesystem());
  format::CheckpointStore store{fs, dir.path() + "/root"};
  persist::ShardWriterPtr real_writer = persist::MakeShardWriter(store.objects_ptr());
  GatedWriter writer{*real_writer};
  cuda::StagingPoolPtr pool = std::move(*cuda::StagingPool::Create(16 << 20, false));
  ProgressSignal progress;
  HotCache hot{progress};  // holds blocks of `pool`: destroyed first
  persist::RetentionKeeper retention;
  std::shared_ptr<RecordingSink> sink = std::make_shared<RecordingSink>();
  // Counted on the committer's threads (a refusal's ends on a thread of its own), read here.
  std::atomic<int> committed{0}, failed{0};
  commit::CommitOptions options;

  explicit Stages(uint32_t keep_last, std::chrono::milliseconds step_timeout)
      : retention(store, {keep_last, 0}, [this](const std::string& j, uint64_t s) { hot.Drop(j, s); },
                  [](const std::string&) {}) {
    (void)fs->MakeDir(store.root());
    options.step_timeout = step_timeout;
  }

  commit::CommitHooks Hooks() {
    commit::CommitHooks hooks;
    hooks.committed = [this](const format::Manifest& m, const std::vector<StagedSnapshotPtr>& local) {
      ++committed;
      hot.Insert(local);
      retention.Schedule(m.job);
    };
    hooks.failed = [this](const std::string&, uint64_t, const std::string&) { ++failed; };
    hooks.progress = [this] { progress.Notify(); };
    return hooks;
  }
};

struct SingleNode {
  static constexpr bool kGroup = false;
  explicit SingleNode(Stages& s) : committer(s.store, s.Hooks(), s.options) {}
  commit::SingleNodeCommitter committer;
};

// A coordinator and this node's client over loopback gRPC, as on node 0 of a group.
// Counts the prepares a node sends, passing every call on.
class CountingGroupClient : public group::GroupClient {
 public:
  explicit CountingGroupClient(group::GroupClientPtr real) : real_(std::move(real)) {}
  absl::StatusOr<group::GroupViewData> Join(std::chrono::steady_clock::time_point deadline) override {
    return real_->Join(deadline);
  }
  absl::StatusOr<group::GroupViewData> Heartbeat() override { return real_->Heartbeat(); }
  absl::StatusOr<group::Decision> Prepare(const format::Manifest& part, uint64_t attempt) override {
    prepares.fetch_add(1);
    ranks_prepared.fetch_add(part.shards.size());
    return Tampered(real_->Prepare(part, attempt));
  }
  absl::Status Abort(const std::string& job, uint64_t step, uint64_t attempt, uint64_t run,
                     const std::string& reason) override {
    return real_->Abort(job, step, attempt, run, reason);
  }
  absl::StatusOr<group::Decision> GetOutcome(const std::string& job, uint64_t step,
                                             std::chrono::milliseconds wait, bool whole_manifest,
                                             uint64_t attempt) override {
    return Tampered(real_->GetOutcome(job, step, wait, whole_manifest, attempt));
  }
  absl::StatusOr<std::vector<std::string>> Gather(const std::string& key, uint32_t participant,
                                                  uint32_t participants, std::string payload,
                                                  std::chrono::milliseconds timeout) override {
    return real_->Gather(key, participant, participants, std::move(payload), timeout);
  }
  absl::StatusOr<group::GatherTable::Distinct> GatherDistinct(const std::string& key, uint32_t participant,
                                                              uint32_t participants, std::string payload,
                                                              std::chrono::milliseconds timeout) override {
    return real_->GatherDistinct(key, participant, participants, std::move(payload), timeout);
  }
  absl::StatusOr<bool> DecideSave(const daemon::SaveQuestion& question) override {
    return real_->DecideSave(question);
  }
  void CancelGathers(const std::string& why) override { real_->CancelGathers(why); }

  std::atomic<int> prepares{0};
  std::atomic<size_t> ranks_prepared{0};
  // Changes what a commit says of this node, as a confused coordinator would.
  std::function<void(group::CommittedStep&)> tamper;

 private:
  absl::StatusOr<group::Decision> Tampered(absl::StatusOr<group::Decision> d) {
    if (tamper && d.ok() && d->committed) {
      auto changed = std::make_shared<group::CommittedStep>(*d->committed);
      tamper(*changed);
      d->committed = std::move(changed);
    }
    return d;
  }

  group::GroupClientPtr real_;
};

struct Group {
  static constexpr bool kGroup = true;
  explicit Group(Stages& s) {
    group::GroupOptions o;
    o.num_nodes = 2;
    o.node_rank = 0;
    o.listen_addr = "127.0.0.1:0";
    o.token = "0123456789abcdef0123456789abcdef";
    o.step_timeout = s.options.step_timeout;
    log = group::MakeFileDecisionLog(s.fs, s.dir.path() + "/decisions");
    server = std::move(*group::StartGroupServer(o, 7, log.get()));
    o.coordinator = server->address();
    client = std::make_unique<CountingGroupClient>(std::move(*group::MakeGrpcGroupClient(o, 7, server->address())));
    REQUIRE(client->Join(std::chrono::steady_clock::now() + 5s).ok());  // prepares need it
    committer = std::make_unique<commit::GroupCommitter>(s.store, s.Hooks(), s.options, *client, 0);
    options = o;
  }
  // Another node of the group, joined: it prepares the ranks node 0 does not hold.
  group::GroupClientPtr OtherNode() const {
    group::GroupOptions o = options;
    o.node_rank = 1;
    auto other = std::move(*group::MakeGrpcGroupClient(o, 8, "127.0.0.1:1"));
    REQUIRE(other->Join(std::chrono::steady_clock::now() + 5s).ok());
    return other;
  }
  group::GroupOptions options;
  group::DecisionLogPtr log;
  group::GroupServerPtr server;
  std::unique_ptr<CountingGroupClient> client;
  std::unique_ptr<commit::GroupCommitter> committer;
};

template <typename Kind>
struct Fixture : Stages {
  Kind kind;
  commit::Committer& committer;
  persist::WriteQueue writes;
  uint64_t next_ticket = 1;

  explicit Fixture(uint32_t keep_last = 0, std::chrono::milliseconds step_timeout = 30s)
      : Stages(keep_last, step_timeout), kind(*this), committer(Committer(kind)),
        writes(writer, committer, progress, {2}) {}

  static commit::Committer& Committer(SingleNode& k) { return k.committer; }
  static commit::Committer& Committer(Group& k) { return *k.committer; }

  uint64_t Submit(uint64_t step, uint32_t rank, uint32_t world_size, float value = 1.0f,
                  std::chrono::steady_clock::time_point session_started = {}) {
    auto snap = Snapshot(step, rank, world_size, value, session_started);
    writes.Submit(snap);
    return snap->ticket;
  }

  StagedSnapshotPtr Snapshot(uint64_t step, uint32_t rank, uint32_t world_size, float value = 1.0f,
                             std::chrono::steady_clock::time_point session_started = {}) {
    auto snap = std::make_shared<StagedSnapshot>();
    snap->job = "job";
    snap->step = step;
    snap->rank = rank;
    snap->world_size = world_size;
    snap->block = std::move(*pool->Allocate(64));
    std::fill_n(reinterpret_cast<float*>(snap->block->data()), 16, value);
    snap->shard.rank = rank;
    snap->shard.region = ckpt::ScatteredBytes(snap->block->data(), 64);
    snap->shard.data_bytes = 64;
    snap->shard.entries = {{"w", "F32", {16}, 0, 64}};
    snap->tensor_count = 1;
    snap->placements = {{{16 * world_size}, {16 * rank}, {}}};
    snap->sink = sink;
    snap->ticket = next_ticket++;
    snap->session_started = session_started;
    return snap;
  }
};

}  // namespace

TEMPLATE_TEST_CASE("a step commits only when every rank is written", "[commit]", SingleNode, Group) {
  Fixture<TestType> f;
  uint64_t t0 = f.Submit(10, 0, 2);
  f.writer.Open();
  // Rank 0's write done (within a bound that TSan's slowdown does not reach), and still
  // nothing committed: rank 1 never came.
  REQUIRE(WaitUntil([&] { return !f.committer.InFlight().empty() && f.writes.Pending().empty(); }, 5s));
  CHECK(f.store.ListSteps("job")->empty());
  auto in_flight = f.committer.InFlight();
  REQUIRE(in_flight.size() == 1);
  CHECK(in_flight[0].step == 10);
  CHECK(in_flight[0].missing_ranks == std::vector<uint32_t>{1});
  uint64_t t1 = f.Submit(10, 1, 2);
  CHECK(f.sink->WaitFinal(t0) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(t1) == shm::kTicketCommitted);
  auto manifest = f.store.LoadManifest("job", 10);
  REQUIRE(manifest.ok());
  CHECK(manifest->world_size == 2);
  CHECK(manifest->tensors.at("w").global_shape == std::vector<int64_t>{32});
  CHECK(manifest->tensors.at("w").shards.size() == 2);
  if (TestType::kGroup) {
    REQUIRE(manifest->nodes.size() == 1);
    CHECK(manifest->nodes[0].ranks == std::vector<uint32_t>{0, 1});
  }
  CHECK(format::VerifyCheckpoint(f.store, "job", 10)->ok());
  CHECK(f.committed == 1);
  CHECK(f.committer.InFlight().empty());
}

TEMPLATE_TEST_CASE("one rank's failed write fails the step for every rank and keeps the older one",
                   "[commit]", SingleNode, Group) {
  Fixture<TestType> f;
  f.writer.Open();
  uint64_t good = f.Submit(10, 0, 1);
  REQUIRE(f.sink->WaitFinal(good) == shm::kTicketCommitted);
  f.fs->FailAfter(Op::kWrite, 0, ENOSPC);  // rank 0's shard: one write, gathered
  uint64_t a = f.Submit(20, 0, 2);
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  CHECK(f.sink->error(a).find("No space left") != std::string::npos);
  f.fs->Heal();
  // The other rank of the failed attempt is refused with the step's error.
  uint64_t b = f.Submit(20, 1, 2);
  CHECK(f.sink->WaitFinal(b) == shm::kTicketFailed);
  CHECK(f.sink->error(b).find("No space left") != std::string::npos);
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10});
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 20)));
  CHECK(f.failed == 1);
}

TEMPLATE_TEST_CASE("a rank refused before staging ends its step at once, its other ranks' memory freed; the next "
                   "step commits",
                   "[commit]", SingleNode, Group) {
  // The step timeout is far off: nothing here may wait for it.
  Fixture<TestType> f(0, 60s);
  f.writer.Open();
  const auto registered = std::chrono::steady_clock::now();
  // Rank 0 of step 10 is staged and written; rank 1's snapshot of it is refused (no
  // staging memory under --when-busy=skip): step 10 fails for rank 0 at once.
  uint64_t a = f.Submit(10, 0, 2, 1.0f, registered);
  REQUIRE(WaitUntil([&] { return !f.committer.InFlight().empty() && f.writes.Pending().empty(); }, 5s));
  const auto refused_at = std::chrono::steady_clock::now();
  f.writes.Refused("job", 10, 1, "[job/r1 s10] snapshot skipped: the staging budget is spent");
  CHECK(f.sink->WaitFinal(a, 5s) == shm::kTicketFailed);
  CHECK(std::chrono::steady_clock::now() - refused_at < 5s);
  CHECK_THAT(f.sink->error(a), Catch::Contains("refused") && Catch::Contains("staging budget"));
  CHECK(f.committer.InFlight().empty());
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 10)));
  // Step 11: rank 1 refused first; rank 0 of the same attempt arrives after and is refused
  // at once, its memory with it.
  f.writes.Refused("job", 11, 1, "[job/r1 s11] snapshot skipped: the staging budget is spent");
  REQUIRE(WaitUntil([&] { return f.failed == 2; }, 5s));
  uint64_t b = f.Submit(11, 0, 2, 1.0f, registered);
  CHECK(f.sink->WaitFinal(b, 5s) == shm::kTicketFailed);
  CHECK_THAT(f.sink->error(b), Catch::Contains("refused"));
  CHECK(f.committer.InFlight().empty());
  // Step 12 has both ranks: it commits. A repeat of rank 0's snapshot of it, refused, does
  // not end it (rank 0 is already there), nor does one after the commit.
  uint64_t c0 = f.Submit(12, 0, 2, 1.0f, registered);
  REQUIRE(WaitUntil([&] { return !f.committer.InFlight().empty(); }, 5s));
  f.writes.Refused("job", 12, 0, "[job/r0 s12] snapshot failed: a repeat");
  uint64_t c1 = f.Submit(12, 1, 2, 1.0f, registered);
  CHECK(f.sink->WaitFinal(c0) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(c1) == shm::kTicketCommitted);
  f.writes.Refused("job", 12, 1, "[job/r1 s12] snapshot failed: a repeat after the commit");
  std::this_thread::sleep_for(200ms);
  CHECK(f.failed == 2);
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{12});
}

TEMPLATE_TEST_CASE("a step still missing ranks after the step timeout is aborted and forgotten",
                   "[commit]", SingleNode, Group) {
  Fixture<TestType> f(0, 600ms);
  f.writer.Open();
  size_t idle = f.pool->used();
  uint64_t lonely = f.Submit(10, 0, 3);
  CHECK(f.sink->WaitFinal(lonely, 5s) == shm::kTicketFailed);
  CHECK(f.sink->error(lonely).find("aborted") != std::string::npos);
  CHECK(f.sink->error(lonely).find("1, 2") != std::string::npos);  // the missing ranks
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 10)));
  WaitUntil([&] { return f.pool->used() == idle; }, 2s);
  CHECK(f.pool->used() == idle);  // staging memory released
  CHECK(f.committer.InFlight().empty());
  // A late rank of that attempt is refused; trainers that registered since may save it again.
  uint64_t late = f.Submit(10, 1, 3);
  CHECK(f.sink->WaitFinal(late) == shm::kTicketFailed);
  auto now = std::chrono::steady_clock::now();
  std::vector<uint64_t> again;
  for (uint32_t r = 0; r < 3; ++r) again.push_back(f.Submit(10, r, 3, 2.0f, now));
  for (uint64_t t : again) {
    INFO(f.sink->error(t));
    CHECK(f.sink->WaitFinal(t) == shm::kTicketCommitted);
  }
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10});
}

TEST_CASE("a node prepares all its ranks of a step in one call", "[commit]") {
  Fixture<Group> f;
  std::vector<uint64_t> tickets;
  for (uint32_t r = 0; r < 4; ++r) tickets.push_back(f.Submit(10, r, 4));
  f.writer.Open();  // all four arrived before any is written, as a node's trainers snapshot together
  for (uint64_t t : tickets) CHECK(f.sink->WaitFinal(t) == shm::kTicketCommitted);
  CHECK(f.kind.client->prepares == 1);
  CHECK(f.kind.client->ranks_prepared == 4);
  // A rank that arrives after the others were written is prepared on its own.
  auto early = f.Submit(20, 0, 2);
  WaitUntil([&] { return f.kind.client->prepares == 2; }, 5s);
  auto late = f.Submit(20, 1, 2);
  CHECK(f.sink->WaitFinal(early) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(late) == shm::kTicketCommitted);
  CHECK(f.kind.client->prepares == 3);
}

TEST_CASE("a node refuses a commit of another attempt's ranks: its own files are no part of it and go") {
  Fixture<Group> f;
  // Node 0 is the one node that hears the whole manifest: this test plays node 0 of a
  // group whose answer comes without it, as every other node hears it.
  f.kind.client->tamper = [](group::CommittedStep& c) {
    c.manifest_json.clear();
    for (auto& [node, share] : c.shares) share.attempt += 1;
  };
  f.writer.Open();
  uint64_t t = f.Submit(10, 0, 1);
  CHECK(f.sink->WaitFinal(t) == shm::kTicketFailed);
  CHECK_THAT(f.sink->error(t), Catch::Contains("is of other bytes than this node's attempt"));
  CHECK(f.store.ListSteps("job")->empty());
  // The commit is of an attempt whose files this one replaced: nothing here is part of it.
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 10)));
}

TEMPLATE_TEST_CASE("ranks that disagree on the world size are refused", "[commit]", SingleNode, Group) {
  Fixture<TestType> f;
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2);
  uint64_t b = f.Submit(10, 1, 3);
  CHECK(f.sink->WaitFinal(b) == shm::kTicketFailed);
  CHECK(f.sink->error(b).find("world size") != std::string::npos);
  f.Submit(10, 1, 2);
  CHECK(f.sink->WaitFinal(a) == shm::kTicketCommitted);
}

TEMPLATE_TEST_CASE("committed snapshots stay in memory for hot restore until evicted", "[commit]",
                   SingleNode, Group) {
  Fixture<TestType> f;
  f.writer.Open();
  uint64_t t = f.Submit(10, 0, 1);
  REQUIRE(f.sink->WaitFinal(t) == shm::kTicketCommitted);
  CHECK(f.hot.Find("job", 0, 10) != nullptr);
  CHECK(f.hot.Find("job", 0, 9) == nullptr);
  size_t used = f.pool->used();
  CHECK(f.hot.EvictOne());
  // The block returns to the pool once the I/O thread has let go of it too.
  WaitUntil([&] { return f.pool->used() < used; }, 1s);
  CHECK(f.pool->used() < used);
  CHECK(f.hot.Find("job", 0, 10) == nullptr);
  CHECK_FALSE(f.hot.EvictOne());
}

TEMPLATE_TEST_CASE("retention runs after each commit and spares pinned steps", "[commit]",
                   SingleNode, Group) {
  Fixture<TestType> f(2);
  f.writer.Open();
  persist::RetentionKeeper::Pin pin(f.retention, "job", 10);
  for (uint64_t step : {10, 20, 30, 40}) {
    REQUIRE(f.sink->WaitFinal(f.Submit(step, 0, 1)) == shm::kTicketCommitted);
  }
  std::vector<uint64_t> expected = {10, 30, 40};
  WaitUntil([&] { return *f.store.ListSteps("job") == expected; }, 2s);
  CHECK(*f.store.ListSteps("job") == expected);
  CHECK(f.hot.Find("job", 0, 20) == nullptr);  // deleted steps leave memory too
  // An operator's delete spares a step being restored, and takes the in-memory copy along.
  absl::Status pinned = f.retention.DeleteStep("job", 10).status();
  CHECK(absl::IsFailedPrecondition(pinned));
  CHECK_THAT(Message(pinned), Catch::Contains("in use (being restored"));
  REQUIRE(f.hot.Find("job", 0, 40) != nullptr);
  REQUIRE(f.retention.DeleteStep("job", 40).ok());
  CHECK(f.hot.Find("job", 0, 40) == nullptr);
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10, 30});
}

TEMPLATE_TEST_CASE("a step already committed is refused, the committed one untouched", "[commit]",
                   SingleNode, Group) {
  Fixture<TestType> f;
  f.writer.Open();
  REQUIRE(f.sink->WaitFinal(f.Submit(10, 0, 1)) == shm::kTicketCommitted);
  uint64_t again = f.Submit(10, 0, 1, 3.0f, std::chrono::steady_clock::now());
  CHECK(f.sink->WaitFinal(again) == shm::kTicketFailed);
  CHECK(f.sink->error(again).find("already committed") != std::string::npos);
  CHECK(format::VerifyCheckpoint(f.store, "job", 10)->ok());
}

TEMPLATE_TEST_CASE("late results of an ended attempt never count towards, or fail, a newer one",
                   "[commit]", SingleNode, Group) {
  Fixture<TestType> f;
  auto old = f.Snapshot(10, 0, 1);
  REQUIRE(f.committer.Arrived(old).ok());
  f.committer.Failed(old, "rank 0 failed to write");  // attempt 1 ends
  CHECK(f.sink->WaitFinal(old->ticket) == shm::kTicketFailed);
  // The trainer registers again and saves the step once more: attempt 2.
  auto fresh = f.Snapshot(10, 0, 1, 2.0f, std::chrono::steady_clock::now());
  REQUIRE(f.committer.Arrived(fresh).ok());
  // Attempt 1's I/O thread reports late: neither its shard nor its failure is attempt 2's.
  f.committer.Durable(old, {format::ShardFileName(0), 64, {}});
  f.committer.Failed(old, "late failure of attempt 1");
  CHECK_FALSE(f.committer.StepDirectory(old).ok());
  auto in_flight = f.committer.InFlight();
  REQUIRE(in_flight.size() == 1);
  CHECK(in_flight[0].missing_ranks == std::vector<uint32_t>{0});
  CHECK(f.store.ListSteps("job")->empty());
  CHECK_FALSE(f.sink->told(fresh->ticket));
  f.committer.Shutdown();
  CHECK(f.sink->WaitFinal(fresh->ticket) == shm::kTicketFailed);
}

TEST_CASE("single node: a step missing a rank is abandoned when a newer step commits", "[commit]") {
  Fixture<SingleNode> f;
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

TEST_CASE("single node: a step whose last rank is still being written is not abandoned",
          "[commit]") {
  Fixture<SingleNode> f;
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

TEST_CASE("single node: a complete step whose commit is under way is not abandoned by a newer one",
          "[commit]") {
  // Step 10's last rank is written, and its commit (on that writer's thread) is held at
  // the rename while step 20 commits on the other thread: step 10 must still commit.
  Fixture<SingleNode> f;
  std::mutex mu;
  std::condition_variable cv;
  bool newer_committed = false;
  f.fs->BeforeRename([&](const std::string& from) {
    if (from.find("step-00000010") == std::string::npos) return;
    std::unique_lock lock(mu);
    cv.wait_for(lock, 10s, [&] { return newer_committed; });
  });
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2), b = f.Submit(10, 1, 2);
  uint64_t c = f.Submit(20, 0, 2), d = f.Submit(20, 1, 2);
  CHECK(f.sink->WaitFinal(c) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(d) == shm::kTicketCommitted);
  {
    std::lock_guard lock(mu);
    newer_committed = true;
  }
  cv.notify_all();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketCommitted);
  CHECK(f.sink->WaitFinal(b) == shm::kTicketCommitted);
  CHECK(f.sink->error(a).empty());
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10, 20});
  CHECK(f.failed == 0);
}

TEST_CASE("single node: shutdown fails what it cannot finish and leaves no unfinished directory",
          "[commit]") {
  Fixture<SingleNode> f;
  uint64_t a = f.Submit(10, 0, 2);  // rank 1 never arrives
  std::thread opener([&] {
    std::this_thread::sleep_for(50ms);
    f.writer.Open();
  });
  f.writes.Shutdown(2s);
  f.committer.Shutdown();
  opener.join();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  CHECK(f.sink->error(a).find("shut down") != std::string::npos);
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 10)));
  uint64_t late = f.Submit(20, 0, 1);
  CHECK(f.sink->WaitFinal(late) == shm::kTicketFailed);
}

TEST_CASE("group: a prepared step survives shutdown in .tmp and is resolved at the next start",
          "[commit]") {
  Fixture<Group> f;
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2);  // rank 1 (on "another node") has not prepared yet
  WaitUntil([&] { return !f.committer.InFlight().empty() &&
                         f.committer.InFlight()[0].state == "prepared"; }, 2s);
  f.writes.Shutdown(2s);
  f.kind.committer->Shutdown();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  REQUIRE(f.fs->Exists(f.store.TempStepDir("job", 10)));  // in doubt: kept
  // The other node's rank prepares: the coordinator commits.
  auto other = f.kind.OtherNode()->Prepare(testing::ManifestPart("job", 10, 2, {1}), 1);
  REQUIRE(other.ok());
  CHECK(other->outcome == group::Outcome::kCommitted);
  // "Restart": a new committer adopts the .tmp and applies the recorded decision.
  commit::GroupCommitter restarted(f.store, f.Hooks(), f.options, *f.kind.client, 0);
  restarted.AdoptInDoubt(*f.store.ListTempSteps());
  WaitUntil([&] { return f.store.ListSteps("job")->size() == 1; }, 5s);
  CHECK(*f.store.ListSteps("job") == std::vector<uint64_t>{10});
  CHECK_FALSE(f.fs->Exists(f.store.TempStepDir("job", 10)));
}

TEST_CASE("group: a step in doubt is published from the node's record of what it prepared when the commit "
          "comes without the whole manifest",
          "[commit]") {
  Fixture<Group> f;
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2);
  WaitUntil([&] { return !f.committer.InFlight().empty() &&
                         f.committer.InFlight()[0].state == "prepared"; }, 2s);
  f.writes.Shutdown(2s);
  f.kind.committer->Shutdown();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  REQUIRE(f.fs->Exists(f.store.TempStepDir("job", 10) + "/.prepared.json"));
  auto other = f.kind.OtherNode()->Prepare(testing::ManifestPart("job", 10, 2, {1}), 1);
  REQUIRE(other.ok());
  CHECK(other->outcome == group::Outcome::kCommitted);
  // What every node but node 0 hears, and node 0 after a coordinator that stopped before
  // assembling the whole manifest: the header and this node's share.
  f.kind.client->tamper = [](group::CommittedStep& c) { c.manifest_json.clear(); };
  commit::GroupCommitter restarted(f.store, f.Hooks(), f.options, *f.kind.client, 0);
  restarted.AdoptInDoubt(*f.store.ListTempSteps());
  WaitUntil([&] { return f.store.ListSteps("job")->size() == 1; }, 5s);
  auto manifest = f.store.LoadManifest("job", 10);
  REQUIRE(manifest.ok());
  REQUIRE(manifest->scope.has_value());
  CHECK(manifest->scope->nodes == 2);
  REQUIRE(manifest->shards.size() == 1);
  CHECK(manifest->shards[0].rank == 0);
  CHECK(manifest->scope->step_bytes == manifest->shards[0].bytes + 1001);  // rank 1's part: 1001 bytes
  // Removed once published: just after the rename that made the step appear.
  CHECK(WaitUntil([&] { return !f.fs->Exists(f.store.StepDir("job", 10) + "/.prepared.json"); }, 5s));
  restarted.Shutdown();
}

TEST_CASE("group: a new attempt at a step in doubt is refused and leaves the step's files alone",
          "[commit]") {
  Fixture<Group> f;
  f.writer.Open();
  uint64_t a = f.Submit(10, 0, 2, 1.0f);
  WaitUntil([&] { return !f.committer.InFlight().empty() &&
                         f.committer.InFlight()[0].state == "prepared"; }, 2s);
  f.writes.Shutdown(2s);
  f.kind.committer->Shutdown();
  CHECK(f.sink->WaitFinal(a) == shm::kTicketFailed);
  // The next start holds step 10 in doubt; its trainer saves step 10 again meanwhile.
  commit::GroupCommitter restarted(f.store, f.Hooks(), f.options, *f.kind.client, 0);
  persist::WriteQueue queue(f.writer, restarted, f.progress, {2});
  restarted.AdoptInDoubt(*f.store.ListTempSteps());
  auto again = f.Snapshot(10, 0, 2, 2.0f, std::chrono::steady_clock::now());
  queue.Submit(again);
  CHECK(f.sink->WaitFinal(again->ticket) == shm::kTicketFailed);
  CHECK_THAT(f.sink->error(again->ticket), Catch::Contains("in doubt"));
  REQUIRE(f.fs->Exists(f.store.TempStepDir("job", 10)));
  // The other node's rank completes the step: the first attempt's shard is what commits.
  auto other = f.kind.OtherNode()->Prepare(testing::ManifestPart("job", 10, 2, {1}), 1);
  REQUIRE(other.ok());
  CHECK(other->outcome == group::Outcome::kCommitted);
  WaitUntil([&] { return f.store.ListSteps("job")->size() == 1; }, 5s);
  REQUIRE(*f.store.ListSteps("job") == std::vector<uint64_t>{10});
  auto manifest = f.store.LoadManifest("job", 10);
  REQUIRE(manifest.ok());
  CHECK(manifest->shards[0].bytes > 0);
  queue.Shutdown(2s);
  restarted.Shutdown();
}
