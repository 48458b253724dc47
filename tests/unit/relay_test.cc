// The relay (daemon/group/relay.h) against an upstream the test controls: what queues while
// a batch is upstream goes up in one call, polls for one step share one poll upstream,
// every node hears its own share, and failures reach the nodes below so that they call
// the coordinator themselves.
#include "daemon/group/relay.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "tests/fakes/gather_future.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt::group;
using namespace std::chrono_literals;
namespace pb = ckptd::group::v1;
using Clock = std::chrono::steady_clock;

namespace {

// Answers each prepare with its node rank as the reason and each poll as scripted; holds
// every call while `held`.
class ScriptedUpstream final : public RelayUpstream {
 public:
  absl::StatusOr<pb::PrepareBatchReply> ForwardPrepares(const pb::PrepareBatchRequest& batch) override {
    Hold();
    std::lock_guard lock(mu_);
    batch_sizes.push_back(batch.prepares_size());
    if (!prepare_error.ok()) return prepare_error;
    pb::PrepareBatchReply reply;
    for (const pb::PrepareRequest& p : batch.prepares()) {
      pb::PrepareResult* r = reply.add_results();
      if (p.job() == "bad") {
        r->set_code(3);  // INVALID_ARGUMENT, as the coordinator answers one prepare
        r->set_message("bad job");
        continue;
      }
      r->mutable_reply()->set_outcome(pb::OUTCOME_PENDING);
      r->mutable_reply()->set_reason(std::to_string(p.node_rank()));
    }
    return reply;
  }

  // A view per distinct known version, saying version + 1; node 13 is told to join again.
  absl::StatusOr<pb::HeartbeatBatchReply> ForwardHeartbeats(const pb::HeartbeatBatchRequest& batch) override {
    Hold();
    std::lock_guard lock(mu_);
    batch_sizes.push_back(batch.heartbeats_size());
    pb::HeartbeatBatchReply reply;
    std::map<uint64_t, uint32_t> views;
    for (const pb::HeartbeatRequest& h : batch.heartbeats()) {
      pb::HeartbeatResult* r = reply.add_results();
      if (h.node_rank() == 13) {
        r->set_code(9);  // FAILED_PRECONDITION
        r->set_message("node 13 was marked lost: join again");
        continue;
      }
      auto [it, added] = views.try_emplace(h.known_members_version(), static_cast<uint32_t>(reply.views_size()));
      if (added) reply.add_views()->set_members_version(h.known_members_version() + 1);
      r->set_view(it->second);
    }
    return reply;
  }

  // Answers each merge with its payloads and participants as the round's distinct payloads.
  absl::StatusOr<GatherTable::Distinct> ForwardGather(const std::string& key, uint32_t participants,
                                                      const std::vector<GatherTable::Sent>& sent,
                                                      Clock::time_point) override {
    Hold();
    std::lock_guard lock(mu_);
    gathers.push_back({key, participants, sent});
    if (!gather_error.ok()) return gather_error;
    return ckpt::testing::AsDistinct(sent);
  }

  absl::StatusOr<pb::OutcomeReply> ForwardOutcome(const pb::OutcomeRequest& request) override {
    Hold();
    std::lock_guard lock(mu_);
    polls.push_back(request);
    if (!outcome_error.ok()) return outcome_error;
    pb::OutcomeReply reply;
    reply.set_outcome(outcome);
    if (outcome == pb::OUTCOME_COMMITTED) {
      reply.mutable_committed()->set_world_size(64);
      reply.mutable_committed()->set_digest("d");
      for (uint32_t n : request.shares_for()) {
        if (n == drop_share) continue;
        pb::NodeShare* s = reply.add_shares();
        s->set_node_rank(n);
        s->set_ranks(1);
        s->set_bytes(1000 + n);
        s->set_attempt(7);
      }
    }
    return reply;
  }

  void CancelForwards(const std::string&) override {
    std::lock_guard lock(mu_);
    cancelled = true;
    held = false;
    cv_.notify_all();
  }

  void Release() {
    std::lock_guard lock(mu_);
    held = false;
    cv_.notify_all();
  }
  size_t calls_waiting() {
    std::lock_guard lock(mu_);
    return waiting;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool held = false, cancelled = false;
  size_t waiting = 0;
  absl::Status prepare_error, outcome_error, gather_error;
  struct ForwardedGather {
    std::string key;
    uint32_t participants;
    std::vector<GatherTable::Sent> sent;
  };
  std::vector<ForwardedGather> gathers;
  pb::Outcome outcome = pb::OUTCOME_COMMITTED;
  uint32_t drop_share = UINT32_MAX;  // a node 0 that leaves this node's share out
  std::vector<int> batch_sizes;
  std::vector<pb::OutcomeRequest> polls;

 private:
  void Hold() {
    std::unique_lock lock(mu_);
    ++waiting;
    cv_.wait(lock, [&] { return !held; });
    --waiting;
  }
};

pb::PrepareBatchRequest Batch(std::vector<uint32_t> nodes, const std::string& job = "j") {
  pb::PrepareBatchRequest batch;
  for (uint32_t n : nodes) {
    pb::PrepareRequest* p = batch.add_prepares();
    p->set_node_rank(n);
    p->set_job(job);
    p->set_step(5);
  }
  return batch;
}

pb::HeartbeatBatchRequest Heartbeats(std::vector<std::pair<uint32_t, uint64_t>> node_versions) {
  pb::HeartbeatBatchRequest batch;
  for (auto [node, version] : node_versions) {
    pb::HeartbeatRequest* h = batch.add_heartbeats();
    h->set_node_rank(node);
    h->set_known_members_version(version);
  }
  return batch;
}

pb::OutcomeRequest Poll(uint32_t node, uint64_t step = 5, std::vector<uint32_t> shares_for = {}) {
  pb::OutcomeRequest r;
  r.set_job("j");
  r.set_step(step);
  r.set_node_rank(node);
  r.mutable_shares_for()->Add(shares_for.begin(), shares_for.end());
  return r;
}

using PrepareResult = absl::StatusOr<pb::PrepareBatchReply>;
using HeartbeatResult = absl::StatusOr<pb::HeartbeatBatchReply>;
using OutcomeResult = absl::StatusOr<pb::OutcomeReply>;

std::future<PrepareResult> Send(Relay& relay, pb::PrepareBatchRequest batch) {
  auto promise = std::make_shared<std::promise<PrepareResult>>();
  auto future = promise->get_future();
  relay.Prepare(std::move(batch), [promise](PrepareResult r) { promise->set_value(std::move(r)); });
  return future;
}

std::future<HeartbeatResult> Beat(Relay& relay, pb::HeartbeatBatchRequest batch) {
  auto promise = std::make_shared<std::promise<HeartbeatResult>>();
  auto future = promise->get_future();
  relay.Heartbeat(std::move(batch), [promise](HeartbeatResult r) { promise->set_value(std::move(r)); });
  return future;
}

std::future<OutcomeResult> Ask(Relay& relay, const pb::OutcomeRequest& request, std::chrono::milliseconds wait = 5s) {
  auto promise = std::make_shared<std::promise<OutcomeResult>>();
  auto future = promise->get_future();
  relay.GetOutcome(request, Clock::now() + wait, [promise](OutcomeResult r) { promise->set_value(std::move(r)); });
  return future;
}

bool Ready(std::future<PrepareResult>& f) { return f.wait_for(0s) == std::future_status::ready; }

}  // namespace

TEST_CASE("relay: what queues while a batch is upstream goes up in one call; each node hears its own answer") {
  ScriptedUpstream up;
  up.held = true;
  Relay relay(1, up);
  auto first = Send(relay, Batch({3}));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 1; }, 5s));
  // Four children (one of them a relay below, with two prepares) send while it is up.
  std::vector<std::future<PrepareResult>> later;
  later.push_back(Send(relay, Batch({4})));
  later.push_back(Send(relay, Batch({5, 6})));
  later.push_back(Send(relay, Batch({7}, "bad")));
  later.push_back(Send(relay, Batch({8})));
  up.Release();
  auto r = first.get();
  REQUIRE(r.ok());
  REQUIRE(r->results_size() == 1);
  CHECK(r->results(0).reply().reason() == "3");
  std::vector<PrepareResult> results;
  for (auto& f : later) results.push_back(f.get());
  for (auto& res : results) REQUIRE(res.ok());
  CHECK(results[0]->results(0).reply().reason() == "4");
  REQUIRE(results[1]->results_size() == 2);
  CHECK(results[1]->results(0).reply().reason() == "5");
  CHECK(results[1]->results(1).reply().reason() == "6");
  // One prepare's refusal is its own: the batch it came in is answered.
  CHECK(results[2]->results(0).code() == 3);
  CHECK(results[2]->results(0).message() == "bad job");
  CHECK(results[3]->results(0).reply().reason() == "8");
  CHECK(up.batch_sizes == std::vector<int>{1, 5});
  CHECK(relay.counters().prepares == 6);
  CHECK(relay.counters().batches == 2);
}

TEST_CASE("relay: heartbeats go up in batches; each node hears its own status and the view of its version") {
  ScriptedUpstream up;
  up.held = true;
  Relay relay(1, up);
  auto first = Beat(relay, Heartbeats({{3, 5}}));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 1; }, 5s));
  auto below = Beat(relay, Heartbeats({{4, 5}, {5, 0}, {6, 5}}));  // a relay below, for three
  auto lost = Beat(relay, Heartbeats({{13, 5}}));
  up.Release();
  auto r = first.get();
  REQUIRE(r.ok());
  REQUIRE(r->results_size() == 1);
  REQUIRE(r->views_size() == 1);
  CHECK(r->views(0).members_version() == 6);
  auto b = below.get();
  REQUIRE(b.ok());
  REQUIRE(b->results_size() == 3);
  // Two distinct views for three heartbeats, each named by index.
  REQUIRE(b->views_size() == 2);
  CHECK(b->views(static_cast<int>(b->results(0).view())).members_version() == 6);
  CHECK(b->views(static_cast<int>(b->results(1).view())).members_version() == 1);
  CHECK(b->results(2).view() == b->results(0).view());
  auto l = lost.get();
  REQUIRE(l.ok());
  CHECK(l->results(0).code() == 9);
  CHECK(l->views_size() == 0);
  CHECK(up.batch_sizes == std::vector<int>{1, 4});
  CHECK(relay.counters().heartbeats == 5);
  CHECK(relay.counters().heartbeat_batches == 2);
}

TEST_CASE("relay: a batch upstream is capped in prepares; the rest follows in the next") {
  ScriptedUpstream up;
  up.held = true;
  Relay::Limits limits;
  limits.batch_items = 3;
  Relay relay(1, up, limits);
  auto first = Send(relay, Batch({2}));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 1; }, 5s));
  auto big = Send(relay, Batch({3, 4, 5, 6, 7}));
  up.Release();
  REQUIRE(first.get().ok());
  auto r = big.get();
  REQUIRE(r.ok());
  REQUIRE(r->results_size() == 5);
  for (int i = 0; i < 5; ++i) CHECK(r->results(i).reply().reason() == std::to_string(3 + i));
  CHECK(up.batch_sizes == std::vector<int>{1, 3, 2});
}

TEST_CASE("relay: when its call upstream fails, every batch in it hears the failure (the nodes call node 0)") {
  ScriptedUpstream up;
  up.prepare_error = absl::UnavailableError("parent gone");
  Relay relay(1, up);
  auto r = Send(relay, Batch({3, 4})).get();
  REQUIRE(!r.ok());
  CHECK(absl::IsUnavailable(r.status()));
}

TEST_CASE("relay: beyond its queue bound a batch is refused at once") {
  ScriptedUpstream up;
  up.held = true;
  Relay::Limits limits;
  limits.queued_items = 4;
  Relay relay(1, up, limits);
  auto first = Send(relay, Batch({2}));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 1; }, 5s));
  auto fits = Send(relay, Batch({3, 4, 5, 6}));
  auto refused = Send(relay, Batch({7}));
  REQUIRE(Ready(refused));
  CHECK(absl::IsResourceExhausted(refused.get().status()));
  up.Release();
  CHECK(first.get().ok());
  CHECK(fits.get().ok());
}

TEST_CASE("relay: polls for one step share one poll upstream, and each node hears its own share") {
  ScriptedUpstream up;
  up.held = true;
  Relay relay(1, up);
  auto a = Ask(relay, Poll(3));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 1; }, 5s));
  auto b = Ask(relay, Poll(4));
  auto below = Ask(relay, Poll(5, 5, {11, 12}));  // a relay below asks for its subtree
  up.Release();
  auto ra = a.get();
  REQUIRE(ra.ok());
  CHECK(ra->outcome() == pb::OUTCOME_COMMITTED);
  CHECK(ra->committed().node_bytes() == 1003);
  CHECK(ra->committed().digest() == "d");
  auto rb = b.get();
  REQUIRE(rb.ok());
  CHECK(rb->committed().node_bytes() == 1004);
  auto rbelow = below.get();
  REQUIRE(rbelow.ok());
  CHECK(rbelow->committed().node_bytes() == 1005);
  REQUIRE(rbelow->shares_size() == 2);
  CHECK(rbelow->shares(0).node_rank() == 11);
  CHECK(rbelow->shares(1).bytes() == 1012);
  // The first poll asked for node 3; the second for everyone who came while it was up.
  REQUIRE(up.polls.size() == 2);
  CHECK(std::vector<uint32_t>(up.polls[1].shares_for().begin(), up.polls[1].shares_for().end()) ==
        std::vector<uint32_t>{4, 5, 11, 12});
  // A node that was already covered hears it from the relay alone; a new one costs one
  // poll that does not wait (the step is decided).
  auto again = Ask(relay, Poll(4)).get();
  REQUIRE(again.ok());
  CHECK(again->committed().node_bytes() == 1004);
  CHECK(up.polls.size() == 2);
  auto late = Ask(relay, Poll(9)).get();
  REQUIRE(late.ok());
  CHECK(late->committed().node_bytes() == 1009);
  REQUIRE(up.polls.size() == 3);
  CHECK(up.polls[2].wait_ms() == 0);
  CHECK(std::vector<uint32_t>(up.polls[2].shares_for().begin(), up.polls[2].shares_for().end()) ==
        std::vector<uint32_t>{9});
}

TEST_CASE("relay: a node whose share node 0 did not send hears Unavailable (it asks node 0), never a loop") {
  ScriptedUpstream up;
  up.drop_share = 4;
  Relay relay(1, up);
  auto r3 = Ask(relay, Poll(3));
  auto r3_result = r3.get();
  REQUIRE(r3_result.ok());
  auto r4 = Ask(relay, Poll(4)).get();
  CHECK(absl::IsUnavailable(r4.status()));
  CHECK(up.polls.size() == 2);
}

TEST_CASE("relay: it polls a bounded number of steps at once; beyond, a poll is refused at once") {
  ScriptedUpstream up;
  up.held = true;
  Relay::Limits limits;
  limits.polled_steps = 2;
  Relay relay(1, up, limits);
  auto a = Ask(relay, Poll(3, 5));
  auto b = Ask(relay, Poll(3, 6));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 2; }, 5s));
  auto same_step = Ask(relay, Poll(4, 6));  // joins a step already polled
  auto refused = Ask(relay, Poll(3, 7)).get();
  CHECK(absl::IsResourceExhausted(refused.status()));
  up.Release();
  CHECK(a.get().ok());
  CHECK(b.get().ok());
  CHECK(same_step.get().ok());
}

TEST_CASE("relay: an abort is passed on, never kept: the step may be saved again and commit") {
  ScriptedUpstream up;
  up.outcome = pb::OUTCOME_ABORTED;
  Relay relay(1, up);
  CHECK(Ask(relay, Poll(3)).get()->outcome() == pb::OUTCOME_ABORTED);
  // The trainers save step 5 again (a new attempt), and it commits.
  up.outcome = pb::OUTCOME_COMMITTED;
  auto again = Ask(relay, Poll(3)).get();
  REQUIRE(again.ok());
  CHECK(again->outcome() == pb::OUTCOME_COMMITTED);
  CHECK(again->committed().node_bytes() == 1003);
  CHECK(up.polls.size() == 2);
}

TEST_CASE("relay: a commit it holds is never the answer for a new attempt at the step number (a new run's save)") {
  ScriptedUpstream up;  // commits give every node attempt 7
  Relay relay(1, up);
  auto first = Ask(relay, Poll(3)).get();
  REQUIRE(first.ok());
  CHECK(first->committed().node_attempt() == 7);
  CHECK(up.polls.size() == 1);
  // The same attempt, or one not named, hears the commit held here.
  pb::OutcomeRequest same = Poll(3);
  same.set_attempt(7);
  CHECK(Ask(relay, same).get().ok());
  CHECK(up.polls.size() == 1);
  // A poll for another attempt of node 3's: the commit held is an earlier run's; node 0 is asked.
  pb::OutcomeRequest newer = Poll(3);
  newer.set_attempt(9);
  CHECK(Ask(relay, newer).get().ok());
  CHECK(up.polls.size() == 2);
  // A prepare of the step passing through is a new attempt too: the next poll goes up.
  REQUIRE(Send(relay, Batch({3})).get().ok());
  CHECK(Ask(relay, Poll(3)).get().ok());
  CHECK(up.polls.size() == 3);
}

TEST_CASE("relay: pending is passed on and nothing is kept; an error reaches every waiting poll") {
  ScriptedUpstream up;
  up.outcome = pb::OUTCOME_PENDING;
  Relay relay(1, up);
  CHECK(Ask(relay, Poll(3), 50ms).get()->outcome() == pb::OUTCOME_PENDING);
  up.outcome = pb::OUTCOME_COMMITTED;
  CHECK(Ask(relay, Poll(3)).get()->outcome() == pb::OUTCOME_COMMITTED);
  up.outcome_error = absl::UnavailableError("coordinator gone");
  auto failed = Ask(relay, Poll(4, 6)).get();
  CHECK(absl::IsUnavailable(failed.status()));
}

TEST_CASE("relay: a whole manifest is never relayed") {
  ScriptedUpstream up;
  Relay relay(1, up);
  pb::OutcomeRequest whole = Poll(3);
  whole.set_whole_manifest(true);
  auto r = Ask(relay, whole).get();
  CHECK(absl::IsFailedPrecondition(r.status()));
  CHECK(up.polls.empty());
}

TEST_CASE("relay: Stop answers what waits, ends its calls upstream and refuses what comes after") {
  ScriptedUpstream up;
  up.held = true;
  auto relay = std::make_unique<Relay>(1, up);
  auto upstream_batch = Send(*relay, Batch({2}));
  auto upstream_poll = Ask(*relay, Poll(3));
  REQUIRE(ckpt::testing::WaitUntil([&] { return up.calls_waiting() == 2; }, 5s));
  auto queued = Send(*relay, Batch({4}));
  auto queued_poll = Ask(*relay, Poll(5));
  auto start = Clock::now();
  relay->Stop();
  CHECK(Clock::now() - start < 2s);
  CHECK(up.cancelled);
  CHECK(absl::IsUnavailable(queued.get().status()));
  CHECK(absl::IsUnavailable(queued_poll.get().status()));
  CHECK(!upstream_poll.get().ok());
  CHECK(upstream_batch.get().ok());  // the upstream answered it before it saw the cancel
  CHECK(absl::IsUnavailable(Send(*relay, Batch({6})).get().status()));
  CHECK(absl::IsUnavailable(Ask(*relay, Poll(7)).get().status()));
  relay.reset();
}

namespace {

using ckpt::testing::GatherResult;

std::future<GatherResult> Gather(Relay& relay, uint32_t participants, std::vector<GatherTable::Sent> sent) {
  return ckpt::testing::GatherFuture([&](GatherTable::DistinctDone done) {
    return relay.Gather("restore/j", participants, std::move(sent), Clock::now() + 10s, std::move(done));
  });
}

}  // namespace

TEST_CASE("relay: restore-gather arrivals from the nodes below go up merged, each payload once; all hear the answer") {
  ScriptedUpstream up;
  Relay relay(1, up);
  // Node 2 sends its own ranks 0-1 merged; node 3's relay its subtree's ranks 2-5.
  auto from2 = Gather(relay, 8, {{"steps 4 5", {0, 1}}});
  auto from3 = Gather(relay, 8, {{"steps 4 5", {2, 3, 4}}, {"steps 4", {5}}});
  for (auto* f : {&from2, &from3}) {
    REQUIRE(f->wait_for(5s) == std::future_status::ready);
    GatherResult r = f->get();
    REQUIRE(r.ok());
    REQUIRE(r->payloads.size() == 2);
    CHECK(r->counts[0] + r->counts[1] == 6);
  }
  std::lock_guard lock(up.mu_);
  REQUIRE(up.gathers.size() == 1);
  CHECK(up.gathers[0].key == "restore/j");
  CHECK(up.gathers[0].participants == 8);
  REQUIRE(up.gathers[0].sent.size() == 2);  // by payload
  CHECK(up.gathers[0].sent[0].payload == "steps 4");
  CHECK(up.gathers[0].sent[0].participants == std::vector<uint32_t>{5});
  CHECK(up.gathers[0].sent[1].payload == "steps 4 5");
  CHECK(up.gathers[0].sent[1].participants == std::vector<uint32_t>{0, 1, 2, 3, 4});
  CHECK(relay.counters().gathers == 2);
  CHECK(relay.counters().gather_merges == 1);
}

TEST_CASE("relay: a gather upstream that fails reaches every merged arrival; after Stop gathers are refused") {
  ScriptedUpstream up;
  up.gather_error = absl::UnavailableError("node 0 is restarting");
  auto relay = std::make_unique<Relay>(1, up);
  auto a = Gather(*relay, 4, {{"x", {0}}});
  auto b = Gather(*relay, 4, {{"x", {1}}});
  for (auto* f : {&a, &b}) CHECK(absl::IsUnavailable(f->get().status()));
  relay->Stop();
  CHECK(absl::IsUnavailable(Gather(*relay, 4, {{"x", {2}}}).get().status()));
}
