// The group's pure logic, driven directly with an injected clock and an in-memory
// decision log: the gather table, membership and the two-phase commit coordinator.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "common/status.h"
#include "tests/fakes/manifest_part.h"
#include "daemon/group/commit_coordinator.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/gather_table.h"
#include "daemon/group/membership.h"
#include "format/indexed_manifest.h"
#include "format/manifest.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt;
using namespace ckpt::group;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// Keeps decisions in memory; can be told to fail, as a full disk would.
class MemoryDecisionLog : public DecisionLog {
 public:
  absl::Status RecordCommit(const std::string& job, uint64_t step,
                            const std::string& manifest_json) override {
    {
      std::unique_lock lock(mu_);
      if (job == held_job_) {
        recording_ = true;
        cv_.notify_all();
        cv_.wait(lock, [&] { return held_job_.empty(); });
      }
    }
    std::lock_guard lock(mu_);
    if (fail_) return absl::ResourceExhaustedError("decision log: no space left on device");
    records_[{job, step}] = manifest_json;
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<std::string>> FindCommit(const std::string& job,
                                                        uint64_t step) override {
    std::lock_guard lock(mu_);
    ++finds_;
    auto it = records_.find({job, step});
    if (it == records_.end()) return std::optional<std::string>();
    return std::optional<std::string>(it->second);
  }
  absl::Status RecordManifest(const std::string& job, uint64_t step, const std::string& manifest_json) override {
    std::lock_guard lock(mu_);
    manifests_[{job, step}] = manifest_json;
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<std::string>> FindManifest(const std::string& job, uint64_t step,
                                                          size_t max_bytes) override {
    std::lock_guard lock(mu_);
    auto it = manifests_.find({job, step});
    if (it == manifests_.end()) return std::optional<std::string>();
    if (it->second.size() > max_bytes) return absl::ResourceExhaustedError("too large");
    return std::optional<std::string>(it->second);
  }
  // Also: as if the coordinator had stopped before its assembler recorded this manifest.
  absl::Status ForgetManifest(const std::string& job, uint64_t step) override {
    std::lock_guard lock(mu_);
    manifests_.erase({job, step});
    return absl::OkStatus();
  }
  std::string Record(const std::string& job, uint64_t step) {
    std::lock_guard lock(mu_);
    return records_[{job, step}];
  }
  bool HasManifest(const std::string& job, uint64_t step) {
    std::lock_guard lock(mu_);
    return manifests_.count({job, step}) > 0;
  }
  bool Has(const std::string& job, uint64_t step) {
    std::lock_guard lock(mu_);
    return records_.count({job, step}) > 0;
  }
  void set_fail(bool fail) {
    std::lock_guard lock(mu_);
    fail_ = fail;
  }
  int finds() {
    std::lock_guard lock(mu_);
    return finds_;
  }
  // Holds the records of `job` until Release(), as a slow disk would.
  void Hold(std::string job) {
    std::lock_guard lock(mu_);
    held_job_ = std::move(job);
  }
  void Release() {
    std::lock_guard lock(mu_);
    held_job_.clear();
    cv_.notify_all();
  }
  void WaitRecording() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return recording_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::string held_job_;
  bool recording_ = false;
  int finds_ = 0;
  bool fail_ = false;
  std::map<std::pair<std::string, uint64_t>, std::string> records_;
  std::map<std::pair<std::string, uint64_t>, std::string> manifests_;
};

using ckpt::testing::ManifestPart;

format::Manifest Part(const std::string& job, uint64_t step, uint32_t world_size,
                       std::vector<uint32_t> ranks) {
  return ManifestPart(job, step, world_size, std::move(ranks));
}

using Result = absl::StatusOr<std::vector<std::string>>;

// Collects a gather participant's result.
struct Catcher {
  std::optional<Result> result;
  GatherTable::Done done() {
    return [this](Result r) { result = std::move(r); };
  }
};

}  // namespace

// ---- gather table ----

TEST_CASE("gather: the last arrival completes the round for everyone") {
  GatherTable table;
  auto deadline = Clock::now() + 10s;
  Catcher c[3];
  table.Arrive("restore/job", 2, 3, "two", deadline, c[2].done());
  table.Arrive("restore/job", 0, 3, "zero", deadline, c[0].done());
  CHECK_FALSE(c[0].result.has_value());
  CHECK(table.open_rounds() == 1);
  table.Arrive("restore/job", 1, 3, "one", deadline, c[1].done());
  for (auto& catcher : c) {
    REQUIRE(catcher.result.has_value());
    REQUIRE(catcher.result->ok());
    CHECK(**catcher.result == std::vector<std::string>{"zero", "one", "two"});
  }
  CHECK(table.open_rounds() == 0);
}

TEST_CASE("gather: a distinct gather answers each payload once, with its first sender and count") {
  GatherTable table;
  auto deadline = Clock::now() + 10s;
  std::optional<absl::StatusOr<GatherTable::Distinct>> heard[4];
  const char* payloads[] = {"10,20", "10", "10,20", "20"};
  for (uint32_t p : {3u, 1u, 2u}) {
    table.ArriveDistinct("restore/job", p, 5, payloads[p], deadline,
                         [&heard, p](absl::StatusOr<GatherTable::Distinct> d) { heard[p] = std::move(d); });
  }
  Catcher plain;  // a participant of the same round that asked for every payload
  table.Arrive("restore/job", 4, 5, "10,20", deadline, plain.done());
  CHECK_FALSE(heard[1].has_value());
  table.ArriveDistinct("restore/job", 0, 5, payloads[0], deadline,
                       [&heard](absl::StatusOr<GatherTable::Distinct> d) { heard[0] = std::move(d); });
  for (uint32_t p = 0; p < 4; ++p) {
    INFO("participant " << p);
    REQUIRE(heard[p].has_value());
    REQUIRE(heard[p]->ok());
    CHECK((*heard[p])->payloads == std::vector<std::string>{"10,20", "10", "20"});
    CHECK((*heard[p])->senders == std::vector<uint32_t>{0, 1, 3});
    CHECK((*heard[p])->counts == std::vector<uint32_t>{3, 1, 1});
  }
  REQUIRE(plain.result.has_value());
  CHECK(**plain.result == std::vector<std::string>{"10,20", "10", "10,20", "20", "10,20"});
  // Failures reach distinct arrivals as any other.
  auto alone = table.ArriveDistinctAndWait("k", 0, 2, "x", 50ms);
  REQUIRE_FALSE(alone.ok());
  CHECK_THAT(ckpt::Message(alone.status()), Catch::Contains("missing: 1"));
}

TEST_CASE("gather: a participant arriving again replaces its payload") {
  GatherTable table;
  auto deadline = Clock::now() + 10s;
  Catcher first, retry, other;
  table.Arrive("k", 0, 2, "old", deadline, first.done());
  table.Arrive("k", 0, 2, "new", deadline, retry.done());
  REQUIRE(first.result.has_value());
  CHECK(absl::IsAborted(first.result->status()));
  table.Arrive("k", 1, 2, "b", deadline, other.done());
  REQUIRE(retry.result.has_value());
  CHECK(**retry.result == std::vector<std::string>{"new", "b"});
}

TEST_CASE("gather: a peer that opens rounds without end is refused, the table keeps working") {
  GatherTable table;
  auto deadline = Clock::now() + 10s;
  std::vector<Catcher> held(4096);
  for (size_t i = 0; i < held.size(); ++i) {
    table.Arrive(fmt::format("k{}", i), 0, 2, "", deadline, held[i].done());
  }
  Catcher refused;
  table.Arrive("one-too-many", 0, 2, "", deadline, refused.done());
  REQUIRE(refused.result.has_value());
  CHECK(absl::IsResourceExhausted(refused.result->status()));
  Catcher big;
  table.Arrive("k0", 1, 2, std::string((256 << 20) + 1, 'x'), deadline, big.done());
  CHECK(absl::IsResourceExhausted(big.result->status()));
  Catcher completes;  // an open round still completes
  table.Arrive("k1", 1, 2, "b", deadline, completes.done());
  REQUIRE(completes.result.has_value());
  CHECK(completes.result->ok());
}

TEST_CASE("gather: a participant count that differs from the round's is refused") {
  GatherTable table;
  auto deadline = Clock::now() + 10s;
  Catcher a, wrong, b;
  table.Arrive("k", 0, 2, "a", deadline, a.done());
  table.Arrive("k", 1, 3, "x", deadline, wrong.done());
  REQUIRE(wrong.result.has_value());
  CHECK(absl::IsInvalidArgument(wrong.result->status()));
  CHECK_FALSE(a.result.has_value());  // the round goes on
  table.Arrive("k", 1, 2, "b", deadline, b.done());
  REQUIRE(a.result.has_value());
  CHECK(a.result->ok());

  Catcher outside;
  table.Arrive("k", 5, 2, "x", deadline, outside.done());
  REQUIRE(outside.result.has_value());
  CHECK(absl::IsInvalidArgument(outside.result->status()));
}

TEST_CASE("gather: expiry names the participants still missing") {
  GatherTable table;
  auto now = Clock::now();
  Catcher a, c;
  table.Arrive("barrier", 0, 4, "", now + 100ms, a.done());
  table.Arrive("barrier", 2, 4, "", now + 100ms, c.done());
  table.Expire(now + 50ms);
  CHECK_FALSE(a.result.has_value());
  table.Expire(now + 200ms);
  REQUIRE(a.result.has_value());
  CHECK(absl::IsDeadlineExceeded(a.result->status()));
  CHECK_THAT(Message(a.result->status()), Catch::Contains("missing: 1, 3"));
  CHECK_THAT(Message(a.result->status()), Catch::Contains("barrier"));
  REQUIRE(c.result.has_value());
  CHECK(table.open_rounds() == 0);
}

TEST_CASE("gather: FailAll fails every waiting arrival") {
  GatherTable table;
  Catcher a;
  table.Arrive("k", 0, 2, "", Clock::now() + 10s, a.done());
  table.FailAll("shutting down");
  REQUIRE(a.result.has_value());
  CHECK(absl::IsUnavailable(a.result->status()));
}

TEST_CASE("gather: ArriveAndWait returns across threads, and times out alone") {
  GatherTable table;
  Result other;
  std::thread t([&] { other = table.ArriveAndWait("k", 1, 2, "b", 5s); });
  Result mine = table.ArriveAndWait("k", 0, 2, "a", 5s);
  t.join();
  REQUIRE(mine.ok());
  CHECK(*mine == std::vector<std::string>{"a", "b"});
  REQUIRE(other.ok());

  auto start = Clock::now();
  Result alone = table.ArriveAndWait("lonely", 0, 2, "a", 50ms);
  CHECK(absl::IsDeadlineExceeded(alone.status()));
  CHECK_THAT(Message(alone.status()), Catch::Contains("missing: 1"));
  CHECK(Clock::now() - start < 2s);
}

// ---- membership ----

TEST_CASE("membership: nodes join and are seen alive") {
  Membership m(3, 1s);
  bool restarted = true;
  REQUIRE(m.Join(1, 3, "10.0.0.2:7000", 42, &restarted).ok());
  CHECK_FALSE(restarted);
  auto view = m.View();
  REQUIRE(view.size() == 3);
  CHECK(view[0].state == MemberState::kWaiting);
  CHECK(view[0].last_heartbeat_age_s == -1);
  CHECK(view[1].state == MemberState::kAlive);
  CHECK(view[1].address == "10.0.0.2:7000");
  CHECK(view[1].incarnation == 42);
  CHECK(m.Heartbeat(1, 42).ok());
}

TEST_CASE("membership: changes since a version list only the members that changed") {
  Membership m(3, 1s);
  uint64_t v0 = 0;
  CHECK(m.Changes(0, &v0).size() == 3);
  bool restarted = false;
  REQUIRE(m.Join(1, 3, "10.0.0.2:7000", 42, &restarted).ok());
  uint64_t v1 = 0;
  auto changed = m.Changes(v0, &v1);
  REQUIRE(changed.size() == 1);
  CHECK(changed[0].node == 1);
  CHECK(v1 > v0);
  // A heartbeat, or the same join again, changes nothing a node needs to hear.
  REQUIRE(m.Heartbeat(1, 42).ok());
  REQUIRE(m.Join(1, 3, "10.0.0.2:7000", 42, &restarted).ok());
  uint64_t v2 = 0;
  CHECK(m.Changes(v1, &v2).empty());
  CHECK(v2 == v1);
  // Lost is a change.
  std::this_thread::sleep_for(5ms);
  CHECK(m.Expire(Clock::now() + 2s).size() == 1);
  uint64_t v3 = 0;
  auto lost = m.Changes(v2, &v3);
  REQUIRE(lost.size() == 1);
  CHECK(lost[0].state == MemberState::kLost);
  CHECK(m.Changes(v3 + 7, &v3).size() == 3);  // a version this table never had: all
}

TEST_CASE("membership: a node that changed many times is listed once, in node order, whatever the log holds") {
  Membership m(4, 1s);
  bool restarted = false;
  for (uint32_t n : {3u, 0u, 2u}) REQUIRE(m.Join(n, 4, fmt::format("10.0.0.{}:7000", n), 100 + n, &restarted).ok());
  uint64_t joined = 0;
  m.Changes(0, &joined);
  // Node 2 restarts 100 times (its log entries are compacted past 2 x num_nodes), then
  // node 1 joins.
  for (uint64_t i = 1; i <= 100; ++i) REQUIRE(m.Join(2, 4, "10.0.0.2:7000", 1000 + i, &restarted).ok());
  REQUIRE(m.Join(1, 4, "10.0.0.1:7000", 101, &restarted).ok());
  uint64_t now = 0;
  auto changed = m.Changes(joined, &now);
  REQUIRE(changed.size() == 2);
  CHECK(changed[0].node == 1);
  CHECK(changed[1].node == 2);
  CHECK(changed[1].incarnation == 1100);
  CHECK(now == joined + 101);
  uint64_t same = 0;
  CHECK(m.Changes(now, &same).empty());
  CHECK(same == now);
  // From before the first join: every member that changed since, node 3 included.
  uint64_t v = 0;
  CHECK(m.Changes(1, &v).size() == 4);
}

TEST_CASE("membership: a node with another --num-nodes or rank is refused") {
  Membership m(3, 1s);
  bool restarted;
  absl::Status wrong = m.Join(1, 4, "a", 1, &restarted);
  CHECK(absl::IsFailedPrecondition(wrong));
  CHECK_THAT(Message(wrong), Catch::Contains("--num-nodes 4"));
  CHECK(absl::IsInvalidArgument(m.Join(3, 3, "a", 1, &restarted)));
  CHECK(absl::IsInvalidArgument(m.Join(1, 3, "a", 0, &restarted)));
}

TEST_CASE("membership: a join under a new incarnation is a restart") {
  Membership m(2, 1s);
  bool restarted;
  REQUIRE(m.Join(1, 2, "a", 1, &restarted).ok());
  REQUIRE(m.Join(1, 2, "a", 1, &restarted).ok());
  CHECK_FALSE(restarted);  // the same daemon joining again
  REQUIRE(m.Join(1, 2, "a", 2, &restarted).ok());
  CHECK(restarted);
  // The old incarnation's heartbeats are refused.
  CHECK(absl::IsFailedPrecondition(m.Heartbeat(1, 1)));
  CHECK(m.Heartbeat(1, 2).ok());
}

TEST_CASE("membership: a second daemon with the same node rank on another host waits") {
  Membership m(2, 100ms);
  bool restarted;
  REQUIRE(m.Join(1, 2, "10.0.0.2:7000", 7, &restarted).ok());
  absl::Status twin = m.Join(1, 2, "10.0.0.3:7000", 8, &restarted);
  CHECK(absl::IsUnavailable(twin));  // retried by the joiner
  CHECK_THAT(Message(twin), Catch::Contains("--node-rank 1"));
  CHECK_THAT(Message(twin), Catch::Contains("10.0.0.2:7000"));
  CHECK(m.Heartbeat(1, 7).ok());  // the first keeps its place
  // A restart comes from the same host, on any port.
  REQUIRE(m.Join(1, 2, "10.0.0.2:7100", 9, &restarted).ok());
  CHECK(restarted);
  // Once the old one is lost, a replacement on another host gets in.
  m.Expire(Clock::now() + 1s);
  REQUIRE(m.Join(1, 2, "[fd00::3]:7000", 10, &restarted).ok());
}

TEST_CASE("membership: expiry skips its walk until a deadline can pass, and never misses one") {
  Membership m(3, 100ms);
  bool restarted;
  const auto t0 = Clock::now();
  REQUIRE(m.Join(1, 3, "10.0.0.2:7000", 7, &restarted).ok());
  CHECK(m.Expire(t0 + 50ms).empty());  // walks: node 1's deadline is about t0 + 100 ms
  CHECK(m.Expire(t0 + 60ms).empty());  // skips the walk
  auto lost = m.Expire(Clock::now() + 150ms);
  REQUIRE(lost.size() == 1);
  CHECK(lost.front().node == 1);
  // No member alive: a join must set a deadline again.
  REQUIRE(m.Join(2, 3, "10.0.0.3:7000", 8, &restarted).ok());
  // Node 2 keeps heartbeating: never lost, however many ticks come in between.
  for (int i = 0; i < 5; ++i) {
    REQUIRE(m.Heartbeat(2, 8).ok());
    for (const LostMember& l : m.Expire(Clock::now() + 60ms)) CHECK(l.node != 2);
  }
  CHECK(m.View()[2].state == MemberState::kAlive);
  // Once it falls silent it is lost by the first tick past its deadline.
  auto later = m.Expire(Clock::now() + 1s);
  REQUIRE(later.size() == 1);
  CHECK(later[0].node == 2);
  // Lost node 1 joins again: it can expire again.
  REQUIRE(m.Join(1, 3, "10.0.0.2:7000", 9, &restarted).ok());
  auto again = m.Expire(Clock::now() + 1s);
  REQUIRE(again.size() == 1);
  CHECK(again[0].node == 1);
}

TEST_CASE("membership: after the coordinator itself did not run, members get half a timeout to be heard") {
  Membership m(3, 200ms);
  bool restarted;
  REQUIRE(m.Join(1, 3, "10.0.0.2:7000", 7, &restarted).ok());
  REQUIRE(m.Join(2, 3, "10.0.0.3:7000", 8, &restarted).ok());
  // The coordinator did not run for 300 ms: by the clock both members were silent for
  // longer than the timeout, but nobody was reading their heartbeats.
  std::this_thread::sleep_for(300ms);
  const auto resumed = Clock::now();
  CHECK(m.Resumed(resumed) == 2);
  CHECK(m.Expire(resumed).empty());
  CHECK(m.Expire(resumed + 90ms).empty());
  REQUIRE(m.Heartbeat(1, 7).ok());  // node 1's waiting heartbeat is read; node 2 is gone
  auto lost = m.Expire(resumed + 150ms);
  REQUIRE(lost.size() == 1);
  CHECK(lost[0].node == 2);
  // A member heard since keeps its own deadline; a lost one stays lost.
  CHECK(m.Resumed(Clock::now()) == 0);
  CHECK(m.View()[2].state == MemberState::kLost);
}

TEST_CASE("membership: a silent member is lost and must join again") {
  Membership m(2, 100ms);
  bool restarted;
  REQUIRE(m.Join(1, 2, "10.0.0.2:7000", 7, &restarted).ok());
  CHECK(m.Expire(Clock::now() + 50ms).empty());
  auto lost = m.Expire(Clock::now() + 500ms);
  REQUIRE(lost.size() == 1);
  CHECK(lost[0].node == 1);
  CHECK_THAT(lost[0].why, Catch::Contains("node 1"));
  CHECK_THAT(lost[0].why, Catch::Contains("lost"));
  CHECK(m.View()[1].state == MemberState::kLost);
  CHECK(m.Expire(Clock::now() + 1s).empty());  // reported once

  absl::Status heartbeat = m.Heartbeat(1, 7);
  CHECK(absl::IsFailedPrecondition(heartbeat));
  CHECK_THAT(Message(heartbeat), Catch::Contains("join again"));
  REQUIRE(m.Join(1, 2, "10.0.0.2:7000", 7, &restarted).ok());
  CHECK_FALSE(restarted);
  CHECK(m.View()[1].state == MemberState::kAlive);
  CHECK(absl::IsFailedPrecondition(m.Heartbeat(0, 5)));  // never joined
}

// ---- commit coordinator ----

TEST_CASE("commit: all ranks prepared across three nodes commit with a merged manifest") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  CHECK(c.Prepare(0, 1, Part("job", 100, 4, {0, 1})).outcome == Outcome::kPending);
  CHECK(c.Prepare(1, 1, Part("job", 100, 4, {2})).outcome == Outcome::kPending);
  auto in_flight = c.InFlight();
  REQUIRE(in_flight.size() == 1);
  CHECK(in_flight[0].missing_ranks == std::vector<uint32_t>{3});

  Decision d = c.Prepare(2, 1, Part("job", 100, 4, {3}));
  REQUIRE(d.outcome == Outcome::kCommitted);
  // Decided without the whole manifest: it is assembled when node 0 asks for it.
  CHECK(d.committed->manifest_json.empty());
  CHECK(d.committed->header.nodes == 3);
  CHECK(d.committed->shares.at(0).ranks == 2);
  // (The assembler builds it in the background now, or the lookup below does.)
  Decision whole = c.Lookup("job", 100, /*whole_manifest=*/true);
  REQUIRE(whole.outcome == Outcome::kCommitted);
  CHECK(log.HasManifest("job", 100));
  CHECK(whole.committed->header.digest == d.committed->header.digest);
  auto merged = format::ParseManifest(whole.committed->manifest_json, "test");
  REQUIRE(merged.ok());
  CHECK(merged->shards.size() == 4);
  REQUIRE(merged->nodes.size() == 3);
  CHECK(merged->nodes[0].ranks == std::vector<uint32_t>{0, 1});
  CHECK(merged->NodeOf(3) == 2u);
  CHECK(log.Has("job", 100));
  CHECK(c.InFlight().empty());
  CHECK(c.LatestCommitted().at("job") == 100);
  CHECK(c.Lookup("job", 100).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: the decision is durable before any waiter hears committed") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 5, 2, {0}));
  std::optional<Decision> heard;
  bool recorded_when_heard = false;
  c.Await("job", 5, Clock::now() + 10s, [&](const Decision& d) {
    heard = d;
    recorded_when_heard = log.Has("job", 5);
  });
  CHECK_FALSE(heard.has_value());
  c.Prepare(1, 1, Part("job", 5, 2, {1}));
  REQUIRE(heard.has_value());
  CHECK(heard->outcome == Outcome::kCommitted);
  CHECK(recorded_when_heard);
}

TEST_CASE("commit: a decision is recorded without the lock: other steps, polls and retries go on meanwhile") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 10, 2, {0}));
  log.Hold("job");
  std::thread decider([&] { CHECK(c.Prepare(1, 1, Part("job", 10, 2, {1})).outcome == Outcome::kCommitted); });
  log.WaitRecording();  // the decision of step 10 is being written, slowly
  // Meanwhile: another job's step commits, the step being decided answers pending to a
  // poll and to a retried prepare, and nothing can end it.
  c.Prepare(0, 1, Part("other", 3, 1, {0}));
  CHECK(c.Lookup("other", 3).outcome == Outcome::kCommitted);
  CHECK(c.Lookup("job", 10).outcome == Outcome::kPending);
  CHECK(c.Prepare(0, 1, Part("job", 10, 2, {0})).outcome == Outcome::kPending);
  c.Abort("job", 10, 0, 1, "too late to abort");
  c.AbortIncomplete("node 3 lost");
  c.Tick(Clock::now() + 1h);
  std::atomic<int> heard{0};
  c.Await("job", 10, Clock::now() + 1h, [&](const Decision& d) {
    CHECK(d.outcome == Outcome::kCommitted);
    ++heard;
  });
  log.Release();
  decider.join();
  CHECK(heard == 1);
  CHECK(c.Lookup("job", 10).outcome == Outcome::kCommitted);
  CHECK(log.Has("job", 10));
}

TEST_CASE("commit: old manifests leave memory and are read back from the decision log") {
  MemoryDecisionLog log;
  CommitCoordinator::Options options;
  options.recent_manifest_bytes = 1;  // only the newest stays in memory
  CommitCoordinator c(log, options);
  for (uint64_t step = 1; step <= 5; ++step) {
    c.Prepare(0, 1, Part("job", step, 2, {0}));
    REQUIRE(c.Prepare(1, 1, Part("job", step, 2, {1})).outcome == Outcome::kCommitted);
    if (step < 5) c.Lookup("job", step, /*whole_manifest=*/true);  // as node 0 asks
  }
  const int before = log.finds();
  Decision newest = c.Lookup("job", 5, /*whole_manifest=*/true);
  CHECK(newest.outcome == Outcome::kCommitted);
  CHECK_FALSE(newest.committed->manifest_json.empty());
  CHECK(log.finds() == before);  // from memory
  // What nodes other than node 0 ask for stays in memory: the header and their shares.
  Decision header = c.Lookup("job", 2);
  CHECK(header.outcome == Outcome::kCommitted);
  CHECK(header.committed->manifest_json.empty());
  CHECK(header.committed->header.world_size == 2);
  CHECK(header.committed->shares.at(1).ranks == 1);
  CHECK(log.finds() == before);
  Decision old = c.Lookup("job", 2, /*whole_manifest=*/true);
  CHECK(old.outcome == Outcome::kCommitted);
  CHECK(log.finds() == before + 1);  // from the log
  auto manifest = format::ParseManifest(old.committed->manifest_json, "test");
  REQUIRE(manifest.ok());
  CHECK(manifest->step == 2);
  // A prepare retried long after its commit still hears committed.
  CHECK(c.Prepare(1, 1, Part("job", 1, 2, {1})).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: the decision record holds ranks and bytes, not tensors; a restart answers from it") {
  MemoryDecisionLog log;
  {
    CommitCoordinator c(log, {});
    c.Prepare(0, 1, Part("job", 7, 4, {0, 1}));
    REQUIRE(c.Prepare(1, 1, Part("job", 7, 4, {2, 3})).outcome == Outcome::kCommitted);
    const std::string record = log.Record("job", 7);
    CHECK_THAT(record, Catch::Contains("\"ckptd-decision\""));
    CHECK_THAT(record, !Catch::Contains("\"w\""));  // no tensor
    // Written directly, as nlohmann writes the same document: records from older ckptds and
    // newer ones hash alike.
    CHECK(nlohmann::json::parse(record).dump() == record);
    auto parsed = ParseDecisionRecord(record);
    REQUIRE(parsed.ok());
    CHECK(parsed->header.digest == format::ManifestDigest(record));
    CHECK(parsed->header.step_bytes == 1000 + 1001 + 1002 + 1003);
    CHECK(parsed->header.step_tensors == 1);
    // Each node's share keeps the attempt and run it was prepared in: what binds the commit
    // to those bytes after a restart too.
    CHECK(parsed->shares.at(1) == NodeShare{2, 2005, 1, Part("job", 7, 4, {2, 3}).run});
    CHECK(parsed->node_of_rank == std::vector<uint32_t>{0, 0, 1, 1});
    // Step 8 commits, but the coordinator stops before its whole manifest is recorded.
    c.Prepare(0, 1, Part("job", 8, 4, {0, 1}));
    REQUIRE(c.Prepare(1, 1, Part("job", 8, 4, {2, 3})).outcome == Outcome::kCommitted);
    c.Lookup("job", 7, /*whole_manifest=*/true);
  }
  REQUIRE(log.ForgetManifest("job", 8).ok());
  CommitCoordinator restarted(log, {});
  Decision seven = restarted.Lookup("job", 7, /*whole_manifest=*/true);
  REQUIRE(seven.outcome == Outcome::kCommitted);
  auto whole = format::ParseManifest(seven.committed->manifest_json, "test");
  REQUIRE(whole.ok());
  CHECK(whole->shards.size() == 4);
  CHECK(seven.committed->header.digest == format::ManifestDigest(log.Record("job", 7)));
  // Step 8: committed, with its header and shares; its whole manifest is gone for good.
  Decision eight = restarted.Lookup("job", 8, /*whole_manifest=*/true);
  REQUIRE(eight.outcome == Outcome::kCommitted);
  CHECK(eight.committed->manifest_json.empty());
  CHECK(eight.committed->whole_unavailable);
  CHECK(eight.committed->shares.at(0).ranks == 2);
  // Every node in doubt that asks hears the same, not only the first.
  for (int i = 0; i < 3; ++i) CHECK(restarted.Lookup("job", 8, /*whole_manifest=*/true).outcome == Outcome::kCommitted);
  // A retried prepare of step 8 hears committed again; another node's claim does not.
  CHECK(restarted.Prepare(1, 1, Part("job", 8, 4, {2, 3})).outcome == Outcome::kCommitted);
  CHECK(restarted.Prepare(0, 1, Part("job", 8, 4, {2})).outcome == Outcome::kAborted);
}

// The size of step 4's whole manifest of two one-rank parts, as the coordinator writes it.
size_t WholeManifestBytes() {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 4, 2, {0}));
  c.Prepare(1, 1, Part("job", 4, 2, {1}));
  return c.Lookup("job", 4, /*whole_manifest=*/true).committed->manifest_json.size();
}

TEST_CASE("commit: a whole manifest larger than a manifest may be is not sent; node 0 gets the header") {
  // Just over the limit, it is still assembled into the decision log (for tools); at more
  // than twice the limit, not assembled at all.
  const bool far_over = GENERATE(false, true);
  MemoryDecisionLog log;
  CommitCoordinator::Options options;
  options.max_whole_manifest_bytes = far_over ? 100 : WholeManifestBytes() - 1;
  CommitCoordinator c(log, options);
  // Node 0 waits for step 4's whole manifest, as it does when it prepared last.
  c.Prepare(0, 1, Part("job", 4, 2, {0}));
  std::mutex mu;
  std::optional<Decision> heard;
  c.Await("job", 4, CommitCoordinator::Clock::now() + 5s,
          [&](const Decision& got) {
            std::lock_guard lock(mu);
            heard = got;
          },
          /*whole_manifest=*/true);
  REQUIRE(c.Prepare(1, 1, Part("job", 4, 2, {1})).outcome == Outcome::kCommitted);
  REQUIRE(testing::WaitUntil([&] {
    std::lock_guard lock(mu);
    return heard.has_value();
  }, 5s));
  for (const Decision& d : {*heard, c.Lookup("job", 4, /*whole_manifest=*/true)}) {
    REQUIRE(d.outcome == Outcome::kCommitted);
    CHECK(d.committed->manifest_json.empty());
    CHECK(d.committed->whole_unavailable);
    CHECK(d.committed->shares.at(1).ranks == 1);
  }
  CHECK(log.HasManifest("job", 4) == !far_over);
  // The same after a restart, from the log: no whole manifest, never "unknown".
  CommitCoordinator restarted(log, options);
  Decision again = restarted.Lookup("job", 4, /*whole_manifest=*/true);
  REQUIRE(again.outcome == Outcome::kCommitted);
  CHECK(again.committed->manifest_json.empty());
  CHECK(again.committed->whole_unavailable);
}

TEST_CASE("commit: while the whole manifest is far too large, nodes keep their checksums; once it fits, they send them") {
  MemoryDecisionLog log;
  CommitCoordinator::Options options;
  options.max_whole_manifest_bytes = 100;  // far under this job's manifest
  auto c = std::make_unique<CommitCoordinator>(log, options);
  auto prepared = [](uint64_t step, uint32_t node, bool withhold) {
    format::SplitResult split = format::SplitPart(Part("job", step, 2, {node}));
    return PreparedPart{split.structure, withhold ? split.values.WithChecksumsWithheld() : split.values};
  };
  // Step 1, checksums sent: the manifest is not assembled, and the answer says that the
  // job's checksums are not used.
  c->Prepare(0, 1, prepared(1, 0, false));
  Decision one = c->Prepare(1, 1, prepared(1, 1, false));
  REQUIRE(one.outcome == Outcome::kCommitted);
  CHECK(one.committed->whole_unavailable);
  CHECK(one.committed->checksums_unused);
  // Step 2, only their counts: committed alike.
  c->Prepare(0, 1, prepared(2, 0, true));
  Decision two = c->Prepare(1, 1, prepared(2, 1, true));
  REQUIRE(two.outcome == Outcome::kCommitted);
  CHECK(two.committed->checksums_unused);
  CHECK(two.committed->shares.at(1).ranks == 1);
  // A count that does not match the structure is refused like a wrong list.
  PreparedPart wrong = prepared(3, 1, true);
  ++wrong.values.withheld;
  Decision refused = c->Prepare(1, 1, std::move(wrong));
  REQUIRE(refused.outcome == Outcome::kAborted);
  CHECK_THAT(refused.reason, Catch::Contains("checksums, but structure"));
  // A coordinator whose limit the manifest fits (restarted with another setting) cannot
  // assemble step 4 from counts: no whole manifest, and the answer tells the nodes to send
  // their checksums again, so that step 5's is built.
  options.max_whole_manifest_bytes = 64 << 20;
  c = std::make_unique<CommitCoordinator>(log, options);
  c->Prepare(0, 1, prepared(4, 0, true));
  Decision four = c->Prepare(1, 1, prepared(4, 1, true));
  REQUIRE(four.outcome == Outcome::kCommitted);
  CHECK(four.committed->whole_unavailable);
  CHECK_FALSE(four.committed->checksums_unused);
  c->Prepare(0, 1, prepared(5, 0, false));
  Decision five = c->Prepare(1, 1, prepared(5, 1, false));
  REQUIRE(five.outcome == Outcome::kCommitted);
  CHECK_FALSE(five.committed->whole_unavailable);
  CHECK_FALSE(five.committed->checksums_unused);
}

TEST_CASE("commit: a coordinator that publishes on a shared root refuses a part without its checksums") {
  MemoryDecisionLog log;
  CommitCoordinator::Options options;
  std::vector<uint64_t> published;
  options.publish.commit = [&](const format::Manifest& whole) {
    published.push_back(whole.step);
    return absl::OkStatus();
  };
  CommitCoordinator c(log, options);
  format::SplitResult split = format::SplitPart(Part("job", 1, 1, {0}));
  Decision d = c.Prepare(0, 1, PreparedPart{split.structure, split.values.WithChecksumsWithheld()});
  REQUIRE(d.outcome == Outcome::kAborted);
  CHECK_THAT(d.reason, Catch::Contains("shared root") && Catch::Contains("stayed on its node"));
  CHECK(published.empty());
  REQUIRE(c.Prepare(0, 2, PreparedPart{split.structure, split.values}).outcome == Outcome::kCommitted);
  CHECK(published == std::vector<uint64_t>{1});
}

TEST_CASE("commit: on a shared root, a step too large for one manifest is published as an index and a part per node") {
  // Just over the limit (assembled, then found too large) and far over it (never assembled).
  const bool far_over = GENERATE(false, true);
  MemoryDecisionLog log;
  CommitCoordinator::Options options;
  options.max_whole_manifest_bytes = far_over ? 100 : WholeManifestBytes() - 1;
  std::vector<format::Manifest> published, parts;
  bool fail_parts = false;
  options.publish.commit = [&](const format::Manifest& m) {
    published.push_back(m);
    return absl::OkStatus();
  };
  options.publish.write_part = [&](const format::Manifest& part, format::Manifest& index) {
    if (fail_parts) return absl::ResourceExhaustedError("no space left on the shared root");
    parts.push_back(part);
    format::AddToIndex(index, part, format::ManifestToJson(part));
    return absl::OkStatus();
  };
  CommitCoordinator c(log, options);
  c.Prepare(0, 1, Part("job", 4, 2, {0}));
  Decision d = c.Prepare(1, 1, Part("job", 4, 2, {1}));
  REQUIRE(d.outcome == Outcome::kCommitted);
  REQUIRE(published.size() == 1);
  const format::Manifest& index = published[0];
  REQUIRE(index.index.has_value());
  // Each part is its node's ranks, scoped to this very decision.
  REQUIRE(parts.size() == 2);
  for (uint32_t node : {0u, 1u}) {
    REQUIRE(parts[node].scope.has_value());
    CHECK(parts[node].scope->node == node);
    CHECK(parts[node].scope->digest == format::ManifestDigest(log.Record("job", 4)));
    CHECK(parts[node].shards.size() == 1);
    CHECK(parts[node].shards[0].rank == node);
  }
  CHECK(index.index->digest == d.committed->header.digest);
  CHECK(index.nodes == std::vector<format::ManifestNode>{{0, {0}}, {1, {1}}});
  // What node 0 hears, and the log keeps, is the index: small, whatever the step's size.
  auto heard = format::ParseManifest(d.committed->manifest_json, "answer");
  REQUIRE(heard.ok());
  CHECK(heard->index.has_value());
  CHECK(log.HasManifest("job", 4));
  CommitCoordinator restarted(log, options);
  Decision again = restarted.Lookup("job", 4, /*whole_manifest=*/true);
  REQUIRE(again.outcome == Outcome::kCommitted);
  CHECK(again.committed->manifest_json == d.committed->manifest_json);

  // A node that prepared its ranks at different times (rank 2, then rank 0) has one part.
  parts.clear();
  c.Prepare(0, 1, Part("job", 6, 3, {2}));
  c.Prepare(1, 1, Part("job", 6, 3, {1}));
  REQUIRE(c.Prepare(0, 1, Part("job", 6, 3, {0})).outcome == Outcome::kCommitted);
  REQUIRE(parts.size() == 2);
  CHECK(parts[0].scope->node == 0);
  REQUIRE(parts[0].shards.size() == 2);
  CHECK(parts[0].shards[0].rank == 0);
  CHECK(parts[0].shards[1].rank == 2);
  CHECK(published.back().nodes == std::vector<format::ManifestNode>{{0, {0, 2}}, {1, {1}}});
  CHECK(format::ParseManifest(format::ManifestToJson(published.back()), "index").ok());

  // A part that cannot be written aborts the step before any decision, naming why.
  fail_parts = true;
  c.Prepare(0, 1, Part("job", 5, 2, {0}));
  Decision five = c.Prepare(1, 1, Part("job", 5, 2, {1}));
  REQUIRE(five.outcome == Outcome::kAborted);
  CHECK_THAT(five.reason, Catch::Contains("cannot be published on the shared root") &&
                              Catch::Contains("no space left on the shared root"));
  CHECK(published.size() == 2);
  CommitCoordinator after(log, options);
  CHECK(after.Lookup("job", 5, /*whole_manifest=*/false).outcome != Outcome::kCommitted);
}

TEST_CASE("commit: steps waiting for their whole manifest are bounded; the oldest is given up, the newest built") {
  // A log that holds the assembler inside its first manifest record until released.
  struct SlowManifestLog : MemoryDecisionLog {
    std::mutex mu;
    std::condition_variable cv;
    bool entered = false, released = false;
    absl::Status RecordManifest(const std::string& job, uint64_t step, const std::string& manifest_json) override {
      {
        std::unique_lock lock(mu);
        entered = true;
        cv.notify_all();
        cv.wait(lock, [&] { return released; });
      }
      return MemoryDecisionLog::RecordManifest(job, step, manifest_json);
    }
  } log;
  CommitCoordinator::Options options;
  options.assembly_queue_bytes = 1;  // two waiting steps are one too many
  CommitCoordinator c(log, options);
  auto commit = [&](uint64_t step) {
    c.Prepare(0, 1, Part("job", step, 2, {0}));
    return c.Prepare(1, 1, Part("job", step, 2, {1})).outcome;
  };
  REQUIRE(commit(1) == Outcome::kCommitted);
  {
    std::unique_lock lock(log.mu);
    REQUIRE(log.cv.wait_for(lock, 5s, [&] { return log.entered; }));  // busy with step 1
  }
  // Node 0 waits for step 2's whole manifest.
  c.Prepare(0, 1, Part("job", 2, 2, {0}));
  std::optional<Decision> heard;
  c.Await("job", 2, CommitCoordinator::Clock::now() + 30s, [&](const Decision& got) { heard = got; },
          /*whole_manifest=*/true);
  REQUIRE(c.Prepare(1, 1, Part("job", 2, 2, {1})).outcome == Outcome::kCommitted);
  CHECK_FALSE(heard);  // queued behind step 1
  REQUIRE(commit(3) == Outcome::kCommitted);
  // Step 3 pushed step 2 out: its waiter hears at once that there is no whole manifest.
  REQUIRE(heard);
  CHECK(heard->outcome == Outcome::kCommitted);
  CHECK(heard->committed->whole_unavailable);
  CHECK(heard->committed->shares.at(1).ranks == 1);
  {
    std::lock_guard lock(log.mu);
    log.released = true;
  }
  log.cv.notify_all();
  // Steps 1 and 3 are built; step 2 never is.
  Decision newest;
  for (int i = 0; i < 500; ++i) {
    newest = c.Lookup("job", 3, /*whole_manifest=*/true);
    if (!newest.committed->manifest_json.empty()) break;
    std::this_thread::sleep_for(10ms);
  }
  CHECK_FALSE(newest.committed->manifest_json.empty());
  CHECK(c.Lookup("job", 2, /*whole_manifest=*/true).committed->whole_unavailable);
  CHECK_FALSE(log.HasManifest("job", 2));
}

TEST_CASE("commit: structures held as summaries commit a checked combination; a new one makes nodes resend them") {
  MemoryDecisionLog log;
  std::vector<std::string> forgotten;
  CommitCoordinator::Options options;
  options.forget_structure = [&](const std::string& digest) { forgotten.push_back(digest); };
  CommitCoordinator c(log, options);
  auto whole = [](uint64_t step, uint32_t world, std::vector<uint32_t> ranks) {
    format::SplitResult split = format::SplitPart(Part("job", step, world, std::move(ranks)));
    return PreparedPart{split.structure, split.values};
  };
  auto summarized = [&](uint64_t step, uint32_t world, std::vector<uint32_t> ranks) {
    PreparedPart part = whole(step, world, std::move(ranks));
    part.structure = format::Summarize(*part.structure);
    return part;
  };
  // Step 1 checks the combination with both structures whole.
  c.Prepare(0, 1, whole(1, 2, {0}));
  REQUIRE(c.Prepare(1, 1, whole(1, 2, {1})).outcome == Outcome::kCommitted);
  // Step 2: node 1's structure is a summary now (the cache was full): the combination is
  // known, so the step commits; node 0 gets no whole manifest of it.
  c.Prepare(0, 1, whole(2, 2, {0}));
  Decision two = c.Prepare(1, 1, summarized(2, 2, {1}));
  REQUIRE(two.outcome == Outcome::kCommitted);
  CHECK(c.Lookup("job", 2, /*whole_manifest=*/true).committed->whole_unavailable);
  CHECK(forgotten.empty());
  // Step 3: a new combination (world size 3, node 2 joins) with node 1 still a summary:
  // aborted, naming why, and every structure of it is dropped, so that every node sends
  // its whole part and the next round holds them all.
  c.Prepare(0, 1, whole(3, 3, {0}));
  c.Prepare(2, 1, whole(3, 3, {2}));
  PreparedPart stale = summarized(3, 3, {1});
  const std::string digest = stale.structure->digest;
  Decision three = c.Prepare(1, 1, std::move(stale));
  REQUIRE(three.outcome == Outcome::kAborted);
  CHECK_THAT(three.reason, Catch::Contains("only a summary") && Catch::Contains("nodes 1"));
  CHECK(forgotten.size() == 3);
  CHECK(std::count(forgotten.begin(), forgotten.end(), digest) == 1);
  // Step 4: sent whole again, the new combination is checked and commits.
  c.Prepare(0, 1, whole(4, 3, {0}));
  c.Prepare(2, 1, whole(4, 3, {2}));
  CHECK(c.Prepare(1, 1, whole(4, 3, {1})).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: an abort before any prepare ends the step: its run's prepares hear it at once, a later run's "
          "commit") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  auto run_now = [] {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  };
  auto part = [](uint32_t rank, uint64_t run) {
    format::Manifest m = Part("job", 5, 2, {rank});
    m.run = run;
    return m;
  };
  const uint64_t before = run_now();
  std::this_thread::sleep_for(2ms);
  // Node 1 refused its rank's snapshot before any node prepared.
  c.Abort("job", 5, 1, 77, "node 1: a rank's snapshot was refused: no staging memory");
  Decision heard = c.Prepare(0, 1, part(0, before));
  REQUIRE(heard.outcome == Outcome::kAborted);
  CHECK_THAT(heard.reason, Catch::Contains("refused"));
  CHECK(c.InFlight().empty());  // no round waits for the step timeout
  // Node 1's late prepare of the refused attempt hears it too.
  CHECK(c.Prepare(1, 77, part(1, before)).outcome == Outcome::kAborted);
  // Trainers that registered again since try the step anew: it commits.
  std::this_thread::sleep_for(2ms);
  const uint64_t after = run_now();
  CHECK(c.Prepare(0, 2, part(0, after)).outcome == Outcome::kPending);
  CHECK(c.Prepare(1, 78, part(1, after)).outcome == Outcome::kCommitted);
  // An abort never undoes a commit, in memory or in the log.
  c.Abort("job", 5, 1, 99, "late");
  CHECK(c.Lookup("job", 5, false).outcome == Outcome::kCommitted);
  CommitCoordinator restarted(log, {});
  restarted.Abort("job", 5, 1, 99, "late");
  CHECK(restarted.Lookup("job", 5, false).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: a damaged decision record is refused, naming the field") {
  CHECK(absl::IsNotFound(ParseDecisionRecord("{\"format\": 5}").status()));
  CHECK(absl::IsNotFound(ParseDecisionRecord("not json").status()));
  const std::string good =
      R"({"format":"ckptd-decision","format_version":1,"job":"j","step":1,"outcome":"committed","world_size":2,)"
      R"("step_bytes":10,"step_tensors":1,"run":0,"unix_time":1.5,"wall_time":"w","metadata":{},)"
      R"("nodes":[{"node":0,"ranks":[0,1],"bytes":10,"structures":[]}]})";
  REQUIRE(ParseDecisionRecord(good).ok());
  auto with = [&](const std::string& from, const std::string& to) {
    std::string bad = good;
    bad.replace(bad.find(from), from.size(), to);
    return ParseDecisionRecord(bad).status();
  };
  CHECK_THAT(ckpt::Message(with("\"world_size\":2", "\"world_size\":1e300")), Catch::Contains("world_size"));
  CHECK_THAT(ckpt::Message(with("\"node\":0", "\"node\":-1")), Catch::Contains("node"));
  CHECK_THAT(ckpt::Message(with("[0,1]", "[0,0]")), Catch::Contains("listed twice"));
  CHECK_THAT(ckpt::Message(with("[0,1]", "[0,7]")), Catch::Contains("outside the world"));
  CHECK(absl::IsDataLoss(with("\"wall_time\":\"w\"", "\"wall_time\":3")));
}

TEST_CASE("commit: a record written by an older ckptd (the whole manifest) still answers") {
  MemoryDecisionLog log;
  format::Manifest whole = Part("job", 3, 2, {0, 1});
  whole.nodes = {{0, {0}}, {1, {1}}};
  const std::string json = format::ManifestToJson(whole);
  REQUIRE(log.RecordCommit("job", 3, json).ok());
  CommitCoordinator c(log, {});
  Decision d = c.Lookup("job", 3, /*whole_manifest=*/true);
  REQUIRE(d.outcome == Outcome::kCommitted);
  CHECK(d.committed->manifest_json == json);
  CHECK(d.committed->header.digest == format::ManifestDigest(json));
  CHECK(d.committed->shares.at(1).ranks == 1);
}

TEST_CASE("commit: parts of a new structure are checked again; disagreeing parts abort") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 1, 2, {0}));
  REQUIRE(c.Prepare(1, 1, Part("job", 1, 2, {1})).outcome == Outcome::kCommitted);
  // Step 2: node 1's piece now overlaps node 0's (same structure on node 0, a new one on 1).
  format::Manifest overlapping = Part("job", 2, 2, {1});
  overlapping.tensors["w"].shards[0].offset = {0};
  c.Prepare(0, 1, Part("job", 2, 2, {0}));
  Decision d = c.Prepare(1, 1, overlapping);
  CHECK(d.outcome == Outcome::kAborted);
  CHECK_THAT(d.reason, Catch::Contains("w"));
  // Step 3, the first structures again: the check made for step 1 still holds.
  c.Prepare(0, 1, Part("job", 3, 2, {0}));
  CHECK(c.Prepare(1, 1, Part("job", 3, 2, {1})).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: a decision that cannot be recorded aborts the step") {
  MemoryDecisionLog log;
  log.set_fail(true);
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 5, 2, {0}));
  std::optional<Decision> heard;
  c.Await("job", 5, Clock::now() + 10s, [&](const Decision& d) { heard = d; });
  Decision d = c.Prepare(1, 1, Part("job", 5, 2, {1}));
  CHECK(d.outcome == Outcome::kAborted);
  CHECK_THAT(d.reason, Catch::Contains("could not record"));
  REQUIRE(heard.has_value());
  CHECK(heard->outcome == Outcome::kAborted);
  CHECK_FALSE(log.Has("job", 5));
}

TEST_CASE("commit: a step still missing ranks at the step timeout aborts naming them") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {.step_timeout = 100ms});
  c.Prepare(0, 1, Part("job", 9, 4, {0, 2}));
  std::optional<Decision> heard;
  c.Await("job", 9, Clock::now() + 1h, [&](const Decision& d) { heard = d; });
  c.Tick(Clock::now());
  CHECK_FALSE(heard.has_value());
  c.Tick(Clock::now() + 1s);
  REQUIRE(heard.has_value());
  CHECK(heard->outcome == Outcome::kAborted);
  CHECK_THAT(heard->reason, Catch::Contains("missing ranks 1, 3"));
  CHECK_THAT(heard->reason, Catch::Contains("prepared by nodes 0"));
  CHECK(c.Lookup("job", 9).outcome == Outcome::kAborted);
}

TEST_CASE("commit: a waiter whose deadline passes hears pending") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 9, 2, {0}));
  std::optional<Decision> heard;
  c.Await("job", 9, Clock::now() + 50ms, [&](const Decision& d) { heard = d; });
  c.Tick(Clock::now() + 100ms);
  REQUIRE(heard.has_value());
  CHECK(heard->outcome == Outcome::kPending);
}

TEST_CASE("commit: a rank prepared by two nodes aborts the step") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 3, 3, {0, 1}));
  Decision d = c.Prepare(1, 1, Part("job", 3, 3, {1}));
  CHECK(d.outcome == Outcome::kAborted);
  CHECK_THAT(d.reason, Catch::Contains("rank 1 was prepared by node 0 and by node 1"));

  Decision mismatch = c.Prepare(0, 1, Part("job", 4, 3, {0}));
  REQUIRE(mismatch.outcome == Outcome::kPending);
  mismatch = c.Prepare(1, 1, Part("job", 4, 5, {1}));
  CHECK(mismatch.outcome == Outcome::kAborted);
  CHECK_THAT(mismatch.reason, Catch::Contains("world size 5"));
}

TEST_CASE("commit: a retried prepare after the commit hears committed again") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 7, 2, {0}));
  REQUIRE(c.Prepare(1, 1, Part("job", 7, 2, {1})).outcome == Outcome::kCommitted);
  Decision again = c.Prepare(1, 1, Part("job", 7, 2, {1}));
  CHECK(again.outcome == Outcome::kCommitted);
  // Another node claiming a rank of the committed step is refused.
  Decision other = c.Prepare(0, 1, Part("job", 7, 2, {1}));
  CHECK(other.outcome == Outcome::kAborted);
  CHECK_THAT(other.reason, Catch::Contains("already committed"));
  // A retried prepare in an open round adds nothing.
  c.Prepare(0, 1, Part("job", 8, 3, {0}));
  CHECK(c.Prepare(0, 1, Part("job", 8, 3, {0})).outcome == Outcome::kPending);
  c.Prepare(1, 1, Part("job", 8, 3, {1}));
  CHECK(c.Prepare(2, 1, Part("job", 8, 3, {2})).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: a new attempt after an abort starts a new round") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 11, 2, {0}));
  c.Abort("job", 11, 1, 1, "node 1: rank 1 failed to write");
  Decision aborted = c.Lookup("job", 11);
  CHECK(aborted.outcome == Outcome::kAborted);
  CHECK_THAT(aborted.reason, Catch::Contains("rank 1 failed"));

  // A late prepare of the aborted attempt hears the abort again and opens no round.
  CHECK(c.Prepare(0, 1, Part("job", 11, 2, {0})).outcome == Outcome::kAborted);
  CHECK(c.InFlight().empty());

  CHECK(c.Prepare(0, 2, Part("job", 11, 2, {0})).outcome == Outcome::kPending);
  CHECK(c.Lookup("job", 11).outcome == Outcome::kPending);
  CHECK(c.Prepare(1, 2, Part("job", 11, 2, {1})).outcome == Outcome::kCommitted);
  // An abort after the commit changes nothing.
  c.Abort("job", 11, 1, 2, "too late");
  CHECK(c.Lookup("job", 11).outcome == Outcome::kCommitted);
}

// A part of the run whose newest rank registered at `run` (wall clock, ns).
format::Manifest RunPart(const std::string& job, uint64_t step, uint32_t world_size,
                         std::vector<uint32_t> ranks, uint64_t run) {
  format::Manifest m = Part(job, step, world_size, std::move(ranks));
  m.run = run;
  return m;
}

uint64_t NowNanos(std::chrono::seconds offset = 0s) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   (std::chrono::system_clock::now() + offset).time_since_epoch())
                                   .count());
}

TEST_CASE("commit: a late prepare from the run the abort ended hears the abort; a new run opens a round") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  const uint64_t run = NowNanos(-60s);
  REQUIRE(c.Prepare(0, 1, RunPart("job", 11, 2, {0}, run)).outcome == Outcome::kPending);
  c.AbortIncomplete("node 1 (10.0.0.2:7000) lost: no heartbeat for 3.0 s");
  // Node 1 was stopped through all of it; it comes back and prepares its queued rank.
  Decision late = c.Prepare(1, 7, RunPart("job", 11, 2, {1}, run));
  CHECK(late.outcome == Outcome::kAborted);
  CHECK_THAT(late.reason, Catch::Contains("node 1 (10.0.0.2:7000) lost"));
  CHECK(c.InFlight().empty());  // no round that could only time out
  // Trainers that registered after the abort save the step again: a new round.
  const uint64_t restarted = NowNanos(1s);
  CHECK(c.Prepare(1, 8, RunPart("job", 11, 2, {1}, restarted)).outcome == Outcome::kPending);
  CHECK(c.Prepare(0, 2, RunPart("job", 11, 2, {0}, restarted)).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: a new run that saves a committed step number again gets a round of its own, never the old "
          "commit") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  const uint64_t first = NowNanos(-60s);
  c.Prepare(0, 1, RunPart("job", 10, 2, {0}, first));
  REQUIRE(c.Prepare(1, 1, RunPart("job", 10, 2, {1}, first)).outcome == Outcome::kCommitted);
  REQUIRE(c.Lookup("job", 10, /*whole_manifest=*/true).committed->manifest_json.find(std::to_string(first)) !=
          std::string::npos);
  REQUIRE(log.HasManifest("job", 10));
  // Run 2 (the same bytes, as a deterministic trainer writes them) saves step 10 again,
  // each node in a newer attempt: a prepare of it is no retry of the commit.
  const uint64_t second = NowNanos();
  Decision pending = c.Prepare(1, 5, RunPart("job", 10, 2, {1}, second));
  CHECK(pending.outcome == Outcome::kPending);
  CHECK_FALSE(log.HasManifest("job", 10));  // the earlier commit's manifest is never sent for the new one
  CHECK(c.Lookup("job", 10).outcome == Outcome::kPending);
  Decision done = c.Prepare(0, 5, RunPart("job", 10, 2, {0}, second));
  REQUIRE(done.outcome == Outcome::kCommitted);
  CHECK(done.committed->header.run == second);
  CHECK(done.committed->shares.at(0) == NodeShare{1, 1000, 5, second});
  // A late prepare of the earlier run is refused, naming why.
  Decision older = c.Prepare(0, 1, RunPart("job", 10, 2, {0}, first));
  CHECK(older.outcome == Outcome::kAborted);
  CHECK_THAT(older.reason, Catch::Contains("already committed by a newer attempt"));
  // What the log says after a coordinator restart is the new commit, attempts and runs too.
  CommitCoordinator restarted(log, {});
  Decision recorded = restarted.Lookup("job", 10);
  REQUIRE(recorded.outcome == Outcome::kCommitted);
  CHECK(recorded.committed->header.run == second);
  CHECK(recorded.committed->shares.at(1) == NodeShare{1, 1001, 5, second});
  // A retry of run 2's prepare hears its commit again; one of another attempt of the same run
  // and node, older, is refused.
  CHECK(restarted.Prepare(1, 5, RunPart("job", 10, 2, {1}, second)).outcome == Outcome::kCommitted);
  CHECK(restarted.Prepare(1, 4, RunPart("job", 10, 2, {1}, second)).outcome == Outcome::kAborted);
}

TEST_CASE("commit: a node that still holds a step an earlier run committed aborts a new run's save of it at once") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  const uint64_t first = NowNanos(-60s);
  c.Prepare(0, 1, RunPart("job", 10, 2, {0}, first));
  REQUIRE(c.Prepare(1, 1, RunPart("job", 10, 2, {1}, first)).outcome == Outcome::kCommitted);
  c.Prepare(0, 2, RunPart("job", 20, 2, {0}, first));
  REQUIRE(c.Prepare(1, 2, RunPart("job", 20, 2, {1}, first)).outcome == Outcome::kCommitted);
  // An abort of step 10 from the earlier run, late, changes nothing.
  c.Abort("job", 10, 1, 1, "late", first);
  CHECK(c.Lookup("job", 10).outcome == Outcome::kCommitted);
  // Run 2's node 1 refused step 10 before any prepare (its disk holds run 1's): the abort
  // carries run 2, and every rank hears it, node 0's when it prepares.
  const uint64_t second = NowNanos(-1s);
  c.Abort("job", 10, 1, 7, "node 1: step 10 of job job is already committed", second);
  Decision refused = c.Prepare(0, 7, RunPart("job", 10, 2, {0}, second));
  CHECK(refused.outcome == Outcome::kAborted);
  CHECK_THAT(refused.reason, Catch::Contains("node 1: step 10 of job job is already committed"));
  CHECK(c.InFlight().empty());
  // The same for a step number the earlier run never committed, below its newest.
  c.Abort("job", 15, 1, 8, "node 1: refused", second);
  CHECK(c.Prepare(0, 8, RunPart("job", 15, 2, {0}, second)).outcome == Outcome::kAborted);
  // Without a run, such an abort is taken for a late one, as before.
  c.Abort("job", 5, 1, 9, "late");
  CHECK(c.Lookup("job", 5).outcome == Outcome::kUnknown);
}

TEST_CASE("commit: while a node of the job is lost, its run's steps abort at their first prepare") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  const uint64_t run = NowNanos(-60s);
  c.Prepare(0, 1, RunPart("job", 10, 3, {0, 1}, run));
  REQUIRE(c.Prepare(1, 1, RunPart("job", 10, 3, {2}, run)).outcome == Outcome::kCommitted);

  c.MemberLost(1, "node 1 (10.0.0.2:7000) lost: no heartbeat for 3.0 s", 5, NowNanos(-3s));
  Decision at_once = c.Prepare(0, 2, RunPart("job", 20, 3, {0, 1}, run));
  CHECK(at_once.outcome == Outcome::kAborted);
  CHECK_THAT(at_once.reason, Catch::Contains("node 1 (10.0.0.2:7000) lost"));
  CHECK_THAT(at_once.reason, Catch::Contains("missing ranks 2"));
  CHECK(c.InFlight().empty());
  // Another job, whose last commit had nothing on node 1, goes on.
  c.Prepare(0, 3, RunPart("other", 5, 1, {0}, run));
  CHECK(c.LatestCommitted().count("other") == 1);
  // The job restarted (on node 0 and a spare, say) after the loss: its steps may commit.
  const uint64_t restarted = NowNanos(1s);
  CHECK(c.Prepare(0, 4, RunPart("job", 20, 3, {0, 1}, restarted)).outcome == Outcome::kPending);
  c.AbortIncomplete("test over");

  // The same run with another world size (it shrank without node 1) is not held.
  CHECK(c.Prepare(0, 4, RunPart("job", 25, 2, {0, 1}, run)).outcome == Outcome::kCommitted);
  // Node 1 joins again: the run that was training goes on committing.
  c.MemberBack(1, 6);
  // A loss that raced with that join and arrives after it is older: ignored.
  c.MemberLost(1, "node 1 lost (stale)", 5, NowNanos(-1s));
  c.Prepare(0, 5, RunPart("job", 30, 3, {0, 1}, run));
  CHECK(c.Prepare(1, 2, RunPart("job", 30, 3, {2}, run)).outcome == Outcome::kCommitted);
}

TEST_CASE("commit: a node's newer attempt replaces its older one; late words of the older are "
          "refused") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  // Node 1 holds ranks 2 and 3. A rank 3 prepare of its first attempt arrives in a round
  // of its own (the abort of that attempt came first and node 1 removed the files).
  CHECK(c.Prepare(1, 10, Part("job", 30, 4, {3})).outcome == Outcome::kPending);
  // The job retries the step: node 0 prepares ranks 0 and 1, node 1 rank 2 in attempt 11.
  c.Prepare(0, 20, Part("job", 30, 4, {0, 1}));
  CHECK(c.Prepare(1, 11, Part("job", 30, 4, {2})).outcome == Outcome::kPending);
  // Rank 3 of attempt 10 no longer counts: the step waits for rank 3 of attempt 11.
  REQUIRE(c.InFlight().size() == 1);
  CHECK(c.InFlight()[0].missing_ranks == std::vector<uint32_t>{3});
  // A late prepare or abort of attempt 10 changes nothing.
  CHECK(c.Prepare(1, 10, Part("job", 30, 4, {3})).outcome == Outcome::kAborted);
  c.Abort("job", 30, 1, 10, "late failure of the old attempt");
  CHECK(c.Lookup("job", 30).outcome == Outcome::kPending);
  Decision d = c.Prepare(1, 11, Part("job", 30, 4, {3}));
  CHECK(d.outcome == Outcome::kCommitted);
}

TEST_CASE("commit: a peer cannot open rounds without end") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  for (uint64_t step = 1; step <= 4096; ++step) {
    REQUIRE(c.Prepare(0, 1, Part("job", step, 2, {0})).outcome == Outcome::kPending);
  }
  Decision refused = c.Prepare(0, 1, Part("job", 5000, 2, {0}));
  CHECK(refused.outcome == Outcome::kAborted);
  CHECK_THAT(refused.reason, Catch::Contains("4096 steps of 8192 ranks in all in flight"));
  CHECK(c.Prepare(1, 1, Part("job", 1, 2, {1})).outcome == Outcome::kCommitted);  // open ones go on
}

TEST_CASE("commit: a lost node aborts undecided steps naming their missing ranks") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  c.Prepare(0, 1, Part("job", 12, 3, {0}));
  c.AbortIncomplete("node 2 lost");
  Decision d = c.Lookup("job", 12);
  CHECK(d.outcome == Outcome::kAborted);
  CHECK_THAT(d.reason, Catch::Contains("node 2 lost"));
  CHECK_THAT(d.reason, Catch::Contains("missing ranks 1, 2"));
}

TEST_CASE("commit: a restarted coordinator answers from the decision log") {
  MemoryDecisionLog log;
  {
    CommitCoordinator before(log, {});
    before.Prepare(0, 1, Part("job", 20, 2, {0}));
    REQUIRE(before.Prepare(1, 1, Part("job", 20, 2, {1})).outcome == Outcome::kCommitted);
    before.Lookup("job", 20, /*whole_manifest=*/true);  // node 0 asked for it
    before.Prepare(0, 1, Part("job", 21, 2, {0}));  // undecided when the coordinator dies
  }
  CommitCoordinator after(log, {});
  CHECK(after.Lookup("job", 20).committed->shares.at(1).ranks == 1);
  Decision committed = after.Lookup("job", 20, /*whole_manifest=*/true);
  CHECK(committed.outcome == Outcome::kCommitted);
  CHECK(format::ParseManifest(committed.committed->manifest_json, "test").ok());
  CHECK(after.Lookup("job", 21).outcome == Outcome::kUnknown);
  CHECK(after.Lookup("other", 1).outcome == Outcome::kUnknown);
  // A node retrying its prepare of the committed step hears committed.
  CHECK(after.Prepare(1, 1, Part("job", 20, 2, {1})).outcome == Outcome::kCommitted);
  std::optional<Decision> heard;
  after.Await("job", 20, Clock::now() + 10s, [&](const Decision& d) { heard = d; });
  REQUIRE(heard.has_value());
  CHECK(heard->outcome == Outcome::kCommitted);
}

TEST_CASE("commit: invalid prepares are refused") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  CHECK(c.Prepare(0, 1, Part("../etc", 1, 1, {0})).outcome == Outcome::kAborted);
  CHECK(c.Prepare(0, 1, Part("job", 1, 0, {})).outcome == Outcome::kAborted);
  CHECK(c.Prepare(0, 1, Part("job", 1, 2, {})).outcome == Outcome::kAborted);
  CHECK(c.Prepare(0, 1, Part("job", 1, 2, {5})).outcome == Outcome::kAborted);
  CHECK(c.InFlight().empty());
}

// ---- file decision log ----

TEST_CASE("file decision log: records survive and old ones are pruned") {
  testing::TempDir dir;
  {
    DecisionLogPtr log = MakeFileDecisionLog(MakePosixFilesystem(), dir / "decisions", 2);
    REQUIRE(log->RecordCommit("job", 1, "{\"one\":1}").ok());
    REQUIRE(log->RecordCommit("job", 2, "{\"two\":2}").ok());
    REQUIRE(log->RecordCommit("job", 3, "{\"three\":3}").ok());
    CHECK(absl::IsInvalidArgument(log->RecordCommit("../x", 1, "{}")));
  }
  DecisionLogPtr log = MakeFileDecisionLog(MakePosixFilesystem(), dir / "decisions", 2);
  auto found = log->FindCommit("job", 3);
  REQUIRE(found.ok());
  REQUIRE(found->has_value());
  CHECK(**found == "{\"three\":3}");
  auto pruned = log->FindCommit("job", 1);
  REQUIRE(pruned.ok());
  CHECK_FALSE(pruned->has_value());
  auto never = log->FindCommit("other", 1);
  REQUIRE(never.ok());
  CHECK_FALSE(never->has_value());
  // A restarted log learns what is on disk once, and goes on pruning from there.
  REQUIRE(log->RecordCommit("job", 4, "{\"four\":4}").ok());
  CHECK_FALSE(log->FindCommit("job", 2)->has_value());
  CHECK(log->FindCommit("job", 3)->has_value());
  CHECK(log->FindCommit("job", 4)->has_value());
  CHECK(std::distance(std::filesystem::directory_iterator(dir / "decisions/job"),
                      std::filesystem::directory_iterator()) == 2);
  // The job went back and commits a lower step: it is kept, the oldest record goes.
  REQUIRE(log->RecordManifest("job", 3, "{\"manifest\":3}").ok());
  REQUIRE(log->RecordManifest("job", 4, "{\"manifest\":4}").ok());
  CHECK(**log->FindManifest("job", 3, 1000) == "{\"manifest\":3}");
  CHECK(absl::IsResourceExhausted(log->FindManifest("job", 3, 4).status()));
  REQUIRE(log->RecordCommit("job", 2, "{\"two again\":2}").ok());
  CHECK(log->FindCommit("job", 2)->has_value());
  CHECK_FALSE(log->FindCommit("job", 3)->has_value());
  CHECK_FALSE(log->FindManifest("job", 3, 1000)->has_value());  // pruned with its record
  CHECK(log->FindCommit("job", 4)->has_value());
  CHECK(log->FindManifest("job", 4, 1000)->has_value());
  CHECK_FALSE(log->FindManifest("job", 2, 1000)->has_value());
}

TEST_CASE("commit: a node's newest prepare of a rank replaces what it said before") {
  MemoryDecisionLog log;
  CommitCoordinator c(log, {});
  format::Manifest old_part = Part("job", 12, 2, {0});
  old_part.shards[0].bytes = 111;
  old_part.tensors["w"] = {"F32", {2}, {{0, "rank-00000.safetensors", 0, 4, {0}, {1}, "old"}}};
  c.Prepare(0, 1, old_part);
  // The rank was written again (a new attempt this coordinator had not told apart): the
  // manifest must describe the file now on disk.
  format::Manifest new_part = Part("job", 12, 2, {0});
  new_part.shards[0].bytes = 222;
  new_part.tensors["w"] = {"F32", {2}, {{0, "rank-00000.safetensors", 0, 4, {0}, {1}, "new"}}};
  CHECK(c.Prepare(0, 1, new_part).outcome == Outcome::kPending);
  format::Manifest other = Part("job", 12, 2, {1});
  other.tensors["w"] = {"F32", {2}, {{1, "rank-00001.safetensors", 0, 4, {1}, {1}, "one"}}};
  REQUIRE(c.Prepare(1, 1, other).outcome == Outcome::kCommitted);
  Decision d = c.Lookup("job", 12, /*whole_manifest=*/true);
  auto m = format::ParseManifest(d.committed->manifest_json, "decision");
  REQUIRE(m.ok());
  CHECK(m->shards[0].bytes == 222);
  REQUIRE(m->tensors.at("w").shards.size() == 2);
  CHECK(m->tensors.at("w").shards[0].checksum == "new");
}
