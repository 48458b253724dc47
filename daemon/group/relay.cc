#include "daemon/group/relay.h"

#include <fmt/format.h>

#include <algorithm>

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

struct Relay::Pending {
  pb::PrepareBatchRequest batch;
  pb::PrepareBatchReply reply;
  size_t left = 0;
  PrepareDone done;  // null once answered
};

Relay::Relay(uint32_t node, RelayUpstream& upstream, Limits limits)
    : node_(node), upstream_(upstream), limits_(limits) {
  flusher_ = std::thread([this] { FlushLoop(); });
}

Relay::~Relay() { Stop(); }

Relay::Counters Relay::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

void Relay::Prepare(pb::PrepareBatchRequest batch, PrepareDone done) {
  auto pending = std::make_shared<Pending>();
  const int n = batch.prepares_size();
  pending->batch = std::move(batch);
  pending->reply.mutable_results()->Reserve(n);
  for (int i = 0; i < n; ++i) pending->reply.add_results();
  pending->left = static_cast<size_t>(n);
  absl::Status refused;
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      refused = Stopped();
    } else if (n == 0) {
      refused = absl::InvalidArgumentError("a batch of no prepares");
    } else if (queue_.size() + static_cast<size_t>(n) > limits_.queued_prepares) {
      refused = absl::ResourceExhaustedError(fmt::format(
          "node {} relays {} prepares already: call the coordinator", node_, queue_.size()));
    } else {
      pending->done = std::move(done);
      for (int i = 0; i < n; ++i) queue_.push_back({pending, i});
    }
  }
  if (!refused.ok()) {
    done(refused);
    return;
  }
  cv_.notify_all();
}

void Relay::FlushLoop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    // Whatever queued while the last batch was upstream goes in this one: no timer, so an
    // idle relay adds no latency and a busy one batches as much as it is sent.
    std::vector<Queued> taken;
    size_t bytes = 0;
    while (!queue_.empty() && taken.size() < limits_.batch_prepares) {
      const Queued& q = queue_.front();
      size_t size = q.from->batch.prepares(q.index).ByteSizeLong();
      if (!taken.empty() && bytes + size > limits_.batch_bytes) break;
      bytes += size;
      taken.push_back(q);
      queue_.pop_front();
    }
    lock.unlock();
    // Each queued prepare is this thread's alone once taken: moved, not copied.
    pb::PrepareBatchRequest request;
    request.mutable_prepares()->Reserve(static_cast<int>(taken.size()));
    for (const Queued& q : taken) request.add_prepares()->Swap(q.from->batch.mutable_prepares(q.index));
    absl::StatusOr<pb::PrepareBatchReply> reply = upstream_.ForwardPrepares(request);
    if (reply.ok() && reply->results_size() != static_cast<int>(taken.size())) {
      reply = absl::InternalError(fmt::format("relay: {} results upstream for {} prepares",
                                              reply->results_size(), taken.size()));
    }
    if (!reply.ok()) {
      Log().warn("node {}: relaying {} prepares failed (the nodes below will call the coordinator): {}",
                 node_, taken.size(), Message(reply.status()));
    }
    std::vector<std::pair<PrepareDone, absl::StatusOr<pb::PrepareBatchReply>>> answers;
    lock.lock();
    counters_.prepares += taken.size();
    ++counters_.batches;
    for (size_t i = 0; i < taken.size(); ++i) {
      Pending& p = *taken[i].from;
      if (!p.done) continue;  // already failed
      if (!reply.ok()) {
        answers.emplace_back(std::move(p.done), reply.status());
        p.done = nullptr;
        continue;
      }
      p.reply.mutable_results(taken[i].index)->Swap(reply->mutable_results(static_cast<int>(i)));
      if (--p.left == 0) {
        answers.emplace_back(std::move(p.done), std::move(p.reply));
        p.done = nullptr;
      }
    }
    lock.unlock();
    for (auto& [done, result] : answers) done(std::move(result));
    lock.lock();
  }
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
      Step& s = steps_[key];
      s.waiters.push_back(std::move(waiter));
      ++waiters_;
      AnswerCoveredLocked(s, later);
      if (!s.waiters.empty() && !s.polling) {
        s.polling = true;
        ++pollers_;
        // Detached and counted: Stop waits for every one to return.
        std::thread([this, key] { PollLoop(key); }).detach();
      }
    }
  }
  for (auto& answer : later) answer();
}

// Every waiter whose node and subtree the decision covers gets its answer: the header, its
// own share and the shares it asked for.
void Relay::AnswerCoveredLocked(Step& s, std::vector<std::function<void()>>& later) {
  if (!s.decided) return;
  auto covered = [&](const Waiter& w) {
    if (s.decided->outcome() != pb::OUTCOME_COMMITTED) return true;
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
      if (auto share = s.shares.find(it->node); share != s.shares.end()) {
        c->set_node_ranks(share->second.ranks());
        c->set_node_bytes(share->second.bytes());
        c->set_node_attempt(share->second.attempt());
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
    } else if (reply->outcome() == pb::OUTCOME_COMMITTED || reply->outcome() == pb::OUTCOME_ABORTED) {
      for (const pb::NodeShare& share : reply->shares()) t.shares[share.node_rank()] = share;
      t.asked.insert(wanted.begin(), wanted.end());
      if (!t.decided) {
        reply->clear_shares();
        t.decided = std::make_unique<pb::OutcomeReply>(std::move(*reply));
        t.decided_order = ++decisions_;
      }
      AnswerCoveredLocked(t, later);
    } else {
      // Pending (or unknown: nothing to keep): every waiter hears it and polls again, as
      // a node's watcher does.
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
    if (stopping_ && !flusher_.joinable()) return;
    stopping_ = true;
    for (Queued& q : queue_) {
      if (q.from->done) {
        later.push_back([d = std::move(q.from->done)] { d(Stopped()); });
        q.from->done = nullptr;
      }
    }
    queue_.clear();
    for (auto& [key, s] : steps_) {
      for (Waiter& w : s.waiters) later.push_back([d = std::move(w.done)] { d(Stopped()); });
      s.waiters.clear();
    }
    waiters_ = 0;
  }
  cv_.notify_all();
  for (auto& answer : later) answer();
  upstream_.CancelForwards("the relay is stopping");
  if (flusher_.joinable()) flusher_.join();
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return pollers_ == 0; });
}

}  // namespace ckpt::group
