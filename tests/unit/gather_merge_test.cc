// Merged gather arrivals: the coordinator's table taking many participants per call
// (GatherTable::ArriveMerged), and the merger that builds those calls on a node and in a
// relay (GatherMerger).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "daemon/group/gather_merger.h"
#include "daemon/group/gather_table.h"
#include "tests/fakes/gather_future.h"

using namespace ckpt::group;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Result = absl::StatusOr<GatherTable::Distinct>;

namespace {

// Where a callback's answer lands.
struct Heard {
  std::mutex mu;
  std::optional<Result> result;
  GatherTable::DistinctDone done() {
    return [this](Result r) {
      std::lock_guard lock(mu);
      REQUIRE_FALSE(result.has_value());  // once only
      result = std::move(r);
    };
  }
  bool has() {
    std::lock_guard lock(mu);
    return result.has_value();
  }
};

std::vector<GatherTable::Sent> Sent(std::vector<std::pair<std::string, std::vector<uint32_t>>> by_payload) {
  std::vector<GatherTable::Sent> out;
  for (auto& [payload, participants] : by_payload) out.push_back({payload, participants});
  return out;
}

}  // namespace

TEST_CASE("gather table: merged arrivals and single ones complete one round; each payload is counted once per sender") {
  GatherTable table;
  Heard a, b, c;
  const auto deadline = Clock::now() + 10s;
  table.ArriveMerged("restore/j", 6, Sent({{"steps 1 2", {0, 1, 2}}, {"steps 1", {4}}}), deadline, a.done());
  table.ArriveDistinct("restore/j", 3, 6, "steps 1 2", deadline, b.done());
  CHECK_FALSE(a.has());
  CHECK(table.open_rounds() == 1);
  table.ArriveMerged("restore/j", 6, Sent({{"steps 1 2", {5}}}), deadline, c.done());
  for (Heard* h : {&a, &b, &c}) {
    REQUIRE(h->has());
    REQUIRE(h->result->ok());
    const GatherTable::Distinct& d = **h->result;
    REQUIRE(d.payloads.size() == 2);
    CHECK(d.payloads[0] == "steps 1 2");
    CHECK(d.senders[0] == 0);
    CHECK(d.counts[0] == 5);
    CHECK(d.payloads[1] == "steps 1");
    CHECK(d.senders[1] == 4);
    CHECK(d.counts[1] == 1);
  }
  CHECK(table.open_rounds() == 0);
}

TEST_CASE("gather table: a merged arrival naming a participant twice or out of range is refused whole") {
  GatherTable table;
  Heard twice, outside, empty;
  const auto deadline = Clock::now() + 10s;
  table.ArriveMerged("k", 4, Sent({{"x", {0, 1}}, {"y", {1}}}), deadline, twice.done());
  table.ArriveMerged("k", 4, Sent({{"x", {2, 4}}}), deadline, outside.done());
  table.ArriveMerged("k", 4, Sent({{"x", {}}}), deadline, empty.done());
  REQUIRE(twice.has());
  CHECK(twice.result->status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(twice.result->status().message().find("participant 1 is named twice") != std::string_view::npos);
  REQUIRE(outside.has());
  CHECK(outside.result->status().message().find("participant 4 is not in 0..3") != std::string_view::npos);
  REQUIRE(empty.has());
  CHECK(empty.result->status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(table.open_rounds() == 0);  // nothing of them was kept
}

TEST_CASE("gather table: participants arriving again are taken from a merged arrival, which hears the round while any is left") {
  GatherTable table;
  Heard merged, retry_one, retry_two;
  const auto deadline = Clock::now() + 10s;
  table.ArriveMerged("k", 3, Sent({{"old", {0, 1}}}), deadline, merged.done());
  // Participant 0 arrives again on its own (its relay failed): the merged arrival keeps 1.
  table.ArriveDistinct("k", 0, 3, "new", deadline, retry_one.done());
  CHECK_FALSE(merged.has());
  table.ArriveDistinct("k", 2, 3, "new", deadline, retry_two.done());
  REQUIRE(merged.has());
  REQUIRE(merged.result->ok());
  // 0's newest payload counts, and 1's from the merged arrival.
  const GatherTable::Distinct& d = **merged.result;
  REQUIRE(d.payloads.size() == 2);
  CHECK(d.payloads[0] == "new");
  CHECK(d.senders[0] == 0);
  CHECK(d.counts[0] == 2);
  CHECK(d.payloads[1] == "old");
  CHECK(d.senders[1] == 1);
  REQUIRE(retry_one.result->ok());

  // Once all of an arrival's participants arrived again, it is told so at once.
  Heard first, second;
  table.ArriveMerged("k2", 3, Sent({{"a", {0, 1}}}), deadline, first.done());
  table.ArriveMerged("k2", 3, Sent({{"b", {1, 0}}}), deadline, second.done());
  REQUIRE(first.has());
  CHECK(first.result->status().code() == absl::StatusCode::kAborted);
  CHECK(first.result->status().message().find("arrived again") != std::string_view::npos);
  CHECK_FALSE(second.has());
  table.FailAll("test over");
  REQUIRE(second.has());
  CHECK(second.result->status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("gather table: an expired merged arrival takes its participants out of the round and names who is missing") {
  GatherTable table;
  Heard early, late;
  const auto now = Clock::now();
  table.ArriveMerged("k", 5, Sent({{"x", {0, 1}}}), now + 1s, early.done());
  table.ArriveMerged("k", 5, Sent({{"x", {2}}}), now + 60s, late.done());
  table.Expire(now + 2s);
  REQUIRE(early.has());
  CHECK(early.result->status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(early.result->status().message().find("3 of 5 arrived; missing: 3, 4") != std::string_view::npos);
  CHECK_FALSE(late.has());
  // 0 and 1 are missing again: the round does not complete without them.
  Heard rest;
  table.ArriveMerged("k", 5, Sent({{"x", {3, 4}}}), now + 60s, rest.done());
  CHECK_FALSE(rest.has());
  Heard back;
  table.ArriveMerged("k", 5, Sent({{"x", {0, 1}}}), now + 60s, back.done());
  for (Heard* h : {&late, &rest, &back}) {
    REQUIRE(h->has());
    REQUIRE(h->result->ok());
    CHECK((*h->result)->counts.at(0) == 5);
  }
}

namespace {

// A Send that records each merge and answers it as the coordinator would once every
// participant of its round came (here: at once, with the merge's own payloads).
struct Upstream {
  std::mutex mu;
  std::vector<std::vector<GatherTable::Sent>> merges;
  std::vector<Clock::time_point> deadlines;
  absl::Status error;
  std::atomic<bool> hold{false};
  GatherMerger::Send send() {
    return [this](const std::string&, uint32_t, const std::vector<GatherTable::Sent>& sent,
                  Clock::time_point deadline) -> Result {
      while (hold) std::this_thread::sleep_for(1ms);
      std::lock_guard lock(mu);
      merges.push_back(sent);
      deadlines.push_back(deadline);
      if (!error.ok()) return error;
      return ckpt::testing::AsDistinct(sent);
    };
  }
  size_t count() {
    std::lock_guard lock(mu);
    return merges.size();
  }
};

std::future<Result> Arrive(GatherMerger& merger, const std::string& key, uint32_t participants, uint32_t p,
                           const std::string& payload, Clock::time_point deadline = Clock::now() + 10s) {
  return ckpt::testing::GatherFuture([&](GatherTable::DistinctDone done) {
    return merger.Arrive(key, participants, {{payload, {p}}}, deadline, std::move(done));
  });
}

}  // namespace

TEST_CASE("gather merger: arrivals within the linger go up as one call, each payload once with its participants") {
  Upstream up;
  GatherMerger merger("test", up.send(), {.linger = 200ms});
  const auto soonest = Clock::now() + 5s;
  std::vector<std::future<Result>> answers;
  answers.push_back(Arrive(merger, "restore/j", 8, 0, "a", soonest + 500ms));
  answers.push_back(Arrive(merger, "restore/j", 8, 1, "a", soonest));
  answers.push_back(Arrive(merger, "restore/j", 8, 2, "b", soonest + 900ms));
  answers.push_back(Arrive(merger, "other", 8, 0, "a"));  // another key: a merge of its own
  for (auto& f : answers) REQUIRE(f.wait_for(5s) == std::future_status::ready);
  for (auto& f : answers) REQUIRE(f.get().ok());
  REQUIRE(up.count() == 2);
  std::lock_guard lock(up.mu);
  const auto& merged = up.merges[0].size() == 2 ? up.merges[0] : up.merges[1];
  const auto deadline = up.merges[0].size() == 2 ? up.deadlines[0] : up.deadlines[1];
  REQUIRE(merged.size() == 2);
  CHECK(merged[0].payload == "a");
  CHECK(merged[0].participants == std::vector<uint32_t>{0, 1});
  CHECK(merged[1].payload == "b");
  CHECK(merged[1].participants == std::vector<uint32_t>{2});
  CHECK(deadline == soonest);  // the earliest of the merged arrivals'
  CHECK(merger.counters().arrivals == 4);
  CHECK(merger.counters().merges == 2);
}

TEST_CASE("gather merger: a participant arriving again closes the open merge; a merge in flight does not hold the next") {
  Upstream up;
  up.hold = true;  // the first merge stays upstream, as a gather waiting for the rest
  GatherMerger merger("test", up.send(), {.linger = 100ms});
  auto first = Arrive(merger, "k", 4, 0, "a");
  auto again = Arrive(merger, "k", 4, 0, "a2");  // a retry: the first merge goes up as it is
  auto other = Arrive(merger, "k", 4, 1, "a");   // joins the second merge
  std::this_thread::sleep_for(300ms);
  CHECK(first.wait_for(0s) == std::future_status::timeout);
  up.hold = false;
  for (auto* f : {&first, &again, &other}) {
    REQUIRE(f->wait_for(5s) == std::future_status::ready);
    REQUIRE(f->get().ok());
  }
  REQUIRE(up.count() == 2);
  std::lock_guard lock(up.mu);
  // The first merge: "a" from 0; the second: "a" from 1 and the retry "a2" from 0.
  const auto& one = up.merges[0].size() == 1 ? up.merges[0] : up.merges[1];
  const auto& two = up.merges[0].size() == 1 ? up.merges[1] : up.merges[0];
  REQUIRE(one.size() == 1);
  CHECK(one[0].payload == "a");
  CHECK(one[0].participants == std::vector<uint32_t>{0});
  REQUIRE(two.size() == 2);
  CHECK(two[0].payload == "a");
  CHECK(two[0].participants == std::vector<uint32_t>{1});
  CHECK(two[1].payload == "a2");
  CHECK(two[1].participants == std::vector<uint32_t>{0});
}

TEST_CASE("gather merger: an error upstream reaches every merged arrival; beyond its bounds an arrival is refused") {
  Upstream up;
  up.error = absl::DeadlineExceededError("restore/j: timed out with 2 of 8 arrived");
  GatherMerger merger("test", up.send(), {.linger = 50ms, .merges = 1});
  auto a = Arrive(merger, "restore/j", 8, 0, "x");
  auto b = Arrive(merger, "restore/j", 8, 1, "x");
  // One merge at most: another key is refused at once (its caller goes to node 0 itself).
  auto refused = Arrive(merger, "restore/k", 8, 0, "x");
  REQUIRE(refused.wait_for(0s) == std::future_status::ready);
  CHECK(refused.get().status().code() == absl::StatusCode::kResourceExhausted);
  for (auto* f : {&a, &b}) {
    REQUIRE(f->wait_for(5s) == std::future_status::ready);
    Result r = f->get();
    CHECK(r.status().code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(r.status().message().find("2 of 8 arrived") != std::string_view::npos);
  }
}

TEST_CASE("gather merger: Stop fails the open merge and refuses what comes later") {
  Upstream up;
  GatherMerger merger("test", up.send(), {.linger = 10s});
  auto open = Arrive(merger, "k", 2, 0, "x");
  merger.Stop("shutting down");
  REQUIRE(open.wait_for(1s) == std::future_status::ready);
  Result r = open.get();
  CHECK(r.status().code() == absl::StatusCode::kUnavailable);
  CHECK(r.status().message().find("shutting down") != std::string_view::npos);
  auto later = Arrive(merger, "k", 2, 1, "x");
  CHECK(later.get().status().code() == absl::StatusCode::kUnavailable);
  CHECK(up.count() == 0);
}

TEST_CASE("gather merger: an invalid arrival is refused before it is merged; a far deadline starts a merge of its own") {
  Upstream up;
  GatherMerger merger("test", up.send(), {.linger = 100ms});
  std::vector<GatherTable::Sent> twice{{"x", {1, 1}}};
  absl::Status refused = merger.Arrive("k", 4, twice, Clock::now() + 10s, [](Result) { FAIL("kept"); });
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK(refused.message().find("participant 1 is named twice") != std::string_view::npos);
  // One arrival with a short deadline does not cut its neighbours' short.
  auto patient = Arrive(merger, "k", 4, 0, "x", Clock::now() + 60s);
  auto hasty = Arrive(merger, "k", 4, 1, "x", Clock::now() + 2s);
  auto patient_too = Arrive(merger, "k", 4, 2, "x", Clock::now() + 60s);
  for (auto* f : {&patient, &hasty, &patient_too}) REQUIRE(f->wait_for(5s) == std::future_status::ready);
  std::lock_guard lock(up.mu);
  REQUIRE(up.merges.size() == 3);
  for (const auto& deadline : up.deadlines) CHECK(deadline - Clock::now() > -1s);  // none took the hasty one's
  size_t hasty_merges = 0;
  for (size_t i = 0; i < up.merges.size(); ++i) {
    if (up.deadlines[i] < Clock::now() + 10s) {
      ++hasty_merges;
      CHECK(up.merges[i].at(0).participants == std::vector<uint32_t>{1});
    }
  }
  CHECK(hasty_merges == 1);
}

TEST_CASE("gather merger: while merges of a key are upstream the next one lingers longer (ranks trickling in)") {
  Upstream up;
  up.hold = true;  // merges stay upstream, as a gather waiting for its last ranks
  GatherMerger merger("test", up.send(), {.linger = 20ms, .max_linger = 160ms});
  std::vector<std::future<Result>> answers;
  // One rank every 50 ms for a second: with a fixed 20 ms linger, 20 merges.
  const auto start = Clock::now();
  for (uint32_t p = 0; p < 20; ++p) {
    answers.push_back(Arrive(merger, "k", 20, p, "x"));
    std::this_thread::sleep_until(start + (p + 1) * 50ms);
  }
  up.hold = false;
  for (auto& f : answers) {
    REQUIRE(f.wait_for(5s) == std::future_status::ready);
    REQUIRE(f.get().ok());
  }
  // Lingers of 20, 40, 80 and then 160 ms: about 9 merges for the 20 arrivals.
  CHECK(up.count() <= 12);
  CHECK(up.count() >= 5);
}
