#include "daemon/group/relay.h"

#include <fmt/format.h>

#include <algorithm>
#include <system_error>
#include <map>

#include "common/log.h"
#include "common/status.h"

namespace ckpt::group {
namespace {

namespace pb = ckptd::group::v1;
using std::chrono::milliseconds;

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

// As the coordinator caps it (group_service.cc): a poll upstream never waits longer.
constexpr milliseconds kMaxOutcomeWait{30'000};
constexpr size_t kMaxSharesFor = 1u << 20;

absl::Status Stopped() { return absl::UnavailableError("the relay is stopping"); }

}  // namespace

Relay::Relay(uint32_t node, RelayUpstream& upstream, Limits limits)
    : node_(node),
      upstream_(upstream),
      limits_(limits),
      prepares_("prepares", {limits.batch_items, limits.batch_bytes, limits.queued_items},
                [this](std::vector<pb::PrepareRequest>& items) { return SendPrepares(items); }),
      heartbeats_("heartbeats", {limits.batch_items, limits.batch_bytes, limits.queued_items},
                  [this](std::vector<pb::HeartbeatRequest>& items) { return SendHeartbeats(items); }),
      gathers_("the relay's gathers",
               [this](const std::string& key, uint32_t participants, const std::vector<GatherTable::Sent>& sent,
                      Clock::time_point deadline) { return upstream_.ForwardGather(key, participants, sent, deadline); },
               GatherMerger::Limits{}) {}

Relay::~Relay() { Stop(); }

Relay::Counters Relay::counters() const {
  Counters c;
  {
    std::lock_guard lock(mu_);
    c = counters_;
  }
  c.prepares = prepares_.items_sent();
  c.batches = prepares_.batches_sent();
  c.heartbeats = heartbeats_.items_sent();
  c.heartbeat_batches = heartbeats_.batches_sent();
  const GatherMerger::Counters g = gathers_.counters();
  c.gathers = g.arrivals;
  c.gather_merges = g.merges;
  return c;
}

absl::Status Relay::Gather(const std::string& key, uint32_t participants, std::vector<GatherTable::Sent> sent,
                           Clock::time_point deadline, GatherTable::DistinctDone done) {
  return gathers_.Arrive(key, participants, std::move(sent), deadline, std::move(done));
}

void Relay::Prepare(pb::PrepareBatchRequest batch, PrepareDone done) {
  std::vector<pb::PrepareRequest> items;
  items.reserve(static_cast<size_t>(batch.prepares_size()));
  {
    // A prepare of a step this relay holds a commit of is a new attempt at the step number
    // (a new run saves it again): that commit is not its answer.
    std::lock_guard lock(mu_);
    for (const pb::PrepareRequest& p : batch.prepares()) ForgetDecidedLocked({p.job(), p.step()});
  }
  for (pb::PrepareRequest& p : *batch.mutable_prepares()) items.push_back(std::move(p));
  auto answer = std::make_shared<PrepareDone>(std::move(done));
  absl::Status queued = prepares_.Add(std::move(items), [answer](absl::StatusOr<std::vector<pb::PrepareResult>> results) {
    if (!results.ok()) return (*answer)(results.status());
    pb::PrepareBatchReply reply;
    reply.mutable_results()->Reserve(static_cast<int>(results->size()));
    for (pb::PrepareResult& r : *results) *reply.add_results() = std::move(r);
    (*answer)(std::move(reply));
  });
  if (!queued.ok()) (*answer)(queued);
}

BatchQueue<pb::PrepareRequest, pb::PrepareResult>::Answers Relay::SendPrepares(std::vector<pb::PrepareRequest>& items) {
  pb::PrepareBatchRequest request;
  request.mutable_prepares()->Reserve(static_cast<int>(items.size()));
  for (pb::PrepareRequest& p : items) *request.add_prepares() = std::move(p);
  absl::StatusOr<pb::PrepareBatchReply> reply = upstream_.ForwardPrepares(request);
  if (!reply.ok()) {
    Log().warn("node {}: relaying {} prepares failed (the nodes below will call the coordinator): {}", node_,
               items.size(), Message(reply.status()));
    return reply.status();
  }
  std::vector<pb::PrepareResult> results;
  results.reserve(static_cast<size_t>(reply->results_size()));
  for (pb::PrepareResult& r : *reply->mutable_results()) results.push_back(std::move(r));
  return results;
}

void Relay::Heartbeat(pb::HeartbeatBatchRequest batch, HeartbeatDone done) {
  std::vector<pb::HeartbeatRequest> items;
  items.reserve(static_cast<size_t>(batch.heartbeats_size()));
  for (pb::HeartbeatRequest& h : *batch.mutable_heartbeats()) items.push_back(std::move(h));
  auto answer = std::make_shared<HeartbeatDone>(std::move(done));
  absl::Status queued = heartbeats_.Add(std::move(items), [answer](absl::StatusOr<std::vector<HeartbeatAnswer>> answers) {
    if (!answers.ok()) return (*answer)(answers.status());
    // Each distinct view once, as node 0 sent them.
    pb::HeartbeatBatchReply reply;
    std::map<const pb::GroupView*, uint32_t> index;
    for (HeartbeatAnswer& a : *answers) {
      pb::HeartbeatResult* result = reply.add_results();
      *result = std::move(a.result);
      if (!a.view) continue;
      auto [it, added] = index.try_emplace(a.view.get(), static_cast<uint32_t>(index.size()));
      if (added) *reply.add_views() = *a.view;
      result->set_view(it->second);
    }
    (*answer)(std::move(reply));
  });
  if (!queued.ok()) (*answer)(queued);
}

BatchQueue<pb::HeartbeatRequest, Relay::HeartbeatAnswer>::Answers Relay::SendHeartbeats(
    std::vector<pb::HeartbeatRequest>& items) {
  pb::HeartbeatBatchRequest request;
  request.mutable_heartbeats()->Reserve(static_cast<int>(items.size()));
  for (pb::HeartbeatRequest& h : items) *request.add_heartbeats() = std::move(h);
  absl::StatusOr<pb::HeartbeatBatchReply> reply = upstream_.ForwardHeartbeats(request);
  if (!reply.ok()) {
    Log().warn("node {}: relaying {} heartbeats failed (the nodes below will call the coordinator): {}", node_,
               items.size(), Message(reply.status()));
    return reply.status();
  }
  std::vector<std::shared_ptr<const pb::GroupView>> views;
  for (pb::GroupView& v : *reply->mutable_views()) views.push_back(std::make_shared<const pb::GroupView>(std::move(v)));
  std::vector<HeartbeatAnswer> answers;
  answers.reserve(static_cast<size_t>(reply->results_size()));
  for (pb::HeartbeatResult& r : *reply->mutable_results()) {
    HeartbeatAnswer a;
    if (r.code() == 0) {
      if (r.view() >= views.size()) {
        return absl::InternalError(fmt::format("relay: a heartbeat's view {} of {} from upstream", r.view(), views.size()));
      }
      a.view = views[r.view()];
    }
    a.result = std::move(r);
    answers.push_back(std::move(a));
  }
  return answers;
}

void Relay::GetOutcome(const pb::OutcomeRequest& request, Clock::time_point deadline, OutcomeDone done) {
  if (request.whole_manifest()) {
    done(absl::FailedPreconditionError("a relay does not carry whole manifests: ask the coordinator"));
    return;
  }
  if (static_cast<size_t>(request.shares_for_size()) > kMaxSharesFor) {
    done(absl::InvalidArgumentError(fmt::format("shares_for names more than {} nodes", kMaxSharesFor)));
    return;
  }
  Waiter waiter{request.node_rank(), {request.shares_for().begin(), request.shares_for().end()}, deadline,
                std::move(done)};
  std::vector<std::function<void()>> later;
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      later.push_back([d = std::move(waiter.done)] { d(Stopped()); });
    } else if (waiters_ >= limits_.outcome_waiters) {
      later.push_back([d = std::move(waiter.done), n = node_] {
        d(absl::ResourceExhaustedError(fmt::format("node {} holds too many outcome polls: ask the coordinator", n)));
      });
    } else {
      StepKey key{request.job(), request.step()};
      auto found = steps_.find(key);
      const bool polling = found != steps_.end() && found->second.polling;
      if (!polling && pollers_ >= static_cast<int>(limits_.polled_steps)) {
        // One thread polls per step; legitimate nodes wait on a few steps at a time.
        later.push_back([d = std::move(waiter.done), n = node_, max = limits_.polled_steps] {
          d(absl::ResourceExhaustedError(
              fmt::format("node {} polls {} steps already: ask the coordinator", n, max)));
        });
      } else {
        if (found != steps_.end() && found->second.decided && request.attempt() != 0) {
          // A commit of another attempt of this node's at the step number: an earlier run's.
          auto share = found->second.shares.find(request.node_rank());
          if (share != found->second.shares.end() && share->second.attempt() != 0 &&
              share->second.attempt() != request.attempt()) {
            ForgetDecidedLocked(key);
          }
        }
        Step& s = steps_[key];
        s.waiters.push_back(std::move(waiter));
        ++waiters_;
        AnswerCoveredLocked(s, later);
        if (!s.waiters.empty() && !s.polling) {
          try {
            // Detached and counted: Stop waits for every one to return.
            std::thread([this, key] { PollLoop(key); }).detach();
            s.polling = true;
            ++pollers_;
          } catch (const std::system_error& e) {
            for (Waiter& w : s.waiters) {
              later.push_back([d = std::move(w.done), why = std::string(e.what())] {
                d(absl::ResourceExhaustedError("the relay cannot start a poller: " + why));
              });
            }
            waiters_ -= s.waiters.size();
            s.waiters.clear();
            if (!s.decided) steps_.erase(key);
          }
        }
      }
    }
  }
  for (auto& answer : later) answer();
}

void Relay::ForgetDecidedLocked(const StepKey& key) {
  auto it = steps_.find(key);
  if (it == steps_.end() || !it->second.decided) return;
  Step& s = it->second;
  s.decided.reset();
  s.shares.clear();
  s.asked.clear();
  if (s.waiters.empty() && !s.polling) steps_.erase(it);
}

// Every waiter whose node and subtree the decision covers gets its answer: the header, its
// own share and the shares it asked for.
void Relay::AnswerCoveredLocked(Step& s, std::vector<std::function<void()>>& later) {
  if (!s.decided) return;
  auto covered = [&](const Waiter& w) {
    if (!s.asked.count(w.node)) return false;
    return std::all_of(w.shares_for.begin(), w.shares_for.end(), [&](uint32_t n) { return s.asked.count(n) > 0; });
  };
  for (auto it = s.waiters.begin(); it != s.waiters.end();) {
    if (!covered(*it)) {
      ++it;
      continue;
    }
    pb::OutcomeReply reply = *s.decided;
    if (reply.outcome() == pb::OUTCOME_COMMITTED) {
      pb::CommittedStep* c = reply.mutable_committed();
      c->clear_node_ranks();
      c->clear_node_bytes();
      c->clear_node_attempt();
      c->clear_node_run();
      if (auto share = s.shares.find(it->node); share != s.shares.end()) {
        c->set_node_ranks(share->second.ranks());
        c->set_node_bytes(share->second.bytes());
        c->set_node_attempt(share->second.attempt());
        c->set_node_run(share->second.run());
      }
      for (uint32_t n : it->shares_for) {
        if (auto share = s.shares.find(n); share != s.shares.end()) *reply.add_shares() = share->second;
      }
    }
    ++counters_.outcome_polls;
    later.push_back([d = std::move(it->done), r = std::move(reply)]() mutable { d(std::move(r)); });
    it = s.waiters.erase(it);
    --waiters_;
  }
}

void Relay::PollLoop(StepKey key) {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    Step& s = steps_.at(key);
    std::vector<std::function<void()>> later;
    if (s.waiters.empty()) {
      s.polling = false;
      if (!s.decided) steps_.erase(key);
      break;
    }
    // Ask for every share a waiter needs that is not known yet; wait as long as the
    // waiter that must be answered first.
    pb::OutcomeRequest request;
    request.set_job(key.first);
    request.set_step(key.second);
    request.set_node_rank(node_);
    std::set<uint32_t> wanted;
    auto now = Clock::now();
    Clock::time_point first = s.waiters.front().deadline;
    for (const Waiter& w : s.waiters) {
      first = std::min(first, w.deadline);
      wanted.insert(w.node);
      wanted.insert(w.shares_for.begin(), w.shares_for.end());
    }
    for (uint32_t n : s.asked) wanted.erase(n);
    request.mutable_shares_for()->Add(wanted.begin(), wanted.end());
    auto wait = std::clamp(std::chrono::duration_cast<milliseconds>(first - now), milliseconds(0), kMaxOutcomeWait);
    request.set_wait_ms(s.decided ? 0 : static_cast<uint32_t>(wait.count()));
    ++counters_.upstream_polls;
    lock.unlock();
    absl::StatusOr<pb::OutcomeReply> reply = upstream_.ForwardOutcome(request);
    lock.lock();
    if (stopping_) break;  // Stop answered every waiter
    Step& t = steps_.at(key);
    if (!reply.ok()) {
      // The nodes below ask the coordinator themselves.
      for (Waiter& w : t.waiters) later.push_back([d = std::move(w.done), st = reply.status()] { d(st); });
      waiters_ -= t.waiters.size();
      t.waiters.clear();
    } else if (reply->outcome() == pb::OUTCOME_COMMITTED) {
      // Only what came back counts as known: a node 0 that sent no share for a node (an
      // older one) sends that node to node 0 itself, rather than around this loop.
      for (const pb::NodeShare& share : reply->shares()) {
        t.shares[share.node_rank()] = share;
        t.asked.insert(share.node_rank());
      }
      if (!t.decided) {
        reply->clear_shares();
        t.decided = std::make_unique<pb::OutcomeReply>(std::move(*reply));
        t.decided_order = ++decisions_;
      }
      AnswerCoveredLocked(t, later);
      auto missing = [&](uint32_t n) { return wanted.count(n) > 0 && t.asked.count(n) == 0; };
      for (auto it = t.waiters.begin(); it != t.waiters.end();) {
        if (!missing(it->node) && std::none_of(it->shares_for.begin(), it->shares_for.end(), missing)) {
          ++it;  // covered, or asked for in the next poll
          continue;
        }
        later.push_back([d = std::move(it->done)] {
          d(absl::UnavailableError("the coordinator sent the relay no share for this node: ask it directly"));
        });
        it = t.waiters.erase(it);
        --waiters_;
      }
    } else {
      // Pending, aborted or unknown: passed on, never kept. Only a commit is final; an
      // aborted step may be saved again under a new attempt, whose polls must not hear
      // the old abort. Every waiter hears it (and, if pending, polls again, as a node's
      // watcher does).
      for (Waiter& w : t.waiters) {
        later.push_back([d = std::move(w.done), r = *reply]() mutable { d(std::move(r)); });
        ++counters_.outcome_polls;
      }
      waiters_ -= t.waiters.size();
      t.waiters.clear();
    }
    ForgetOldDecisionsLocked();
    lock.unlock();
    for (auto& answer : later) answer();
    lock.lock();
  }
  --pollers_;
  cv_.notify_all();
}

void Relay::ForgetOldDecisionsLocked() {
  size_t decided = 0;
  for (const auto& [key, s] : steps_) decided += s.decided != nullptr;
  while (decided > limits_.decided_steps) {
    auto oldest = steps_.end();
    for (auto it = steps_.begin(); it != steps_.end(); ++it) {
      const Step& s = it->second;
      if (!s.decided || s.polling || !s.waiters.empty()) continue;
      if (oldest == steps_.end() || s.decided_order < oldest->second.decided_order) oldest = it;
    }
    if (oldest == steps_.end()) return;
    steps_.erase(oldest);
    --decided;
  }
}

void Relay::Stop() {
  std::vector<std::function<void()>> later;
  {
    std::lock_guard lock(mu_);
    // Once only: the destructor's Stop may come after the upstream (the node's group
    // client) is gone.
    if (stopping_) return;
    stopping_ = true;
    for (auto& [key, s] : steps_) {
      for (Waiter& w : s.waiters) later.push_back([d = std::move(w.done)] { d(Stopped()); });
      s.waiters.clear();
    }
    waiters_ = 0;
  }
  cv_.notify_all();
  for (auto& answer : later) answer();
  // Fails what is queued, then ends the calls upstream in flight, so that the queues'
  // threads return at once.
  prepares_.Close();
  heartbeats_.Close();
  upstream_.CancelForwards("the relay is stopping");
  gathers_.Stop("the relay is stopping");
  prepares_.Stop();
  heartbeats_.Stop();
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return pollers_ == 0; });
}

}  // namespace ckpt::group
