#include "daemon/group/gather_table.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>

namespace ckpt::group {
namespace {

// "1, 3, 5" (at most 16 named): who a timed-out round still waits for.
template <typename Arrived>
std::string Missing(uint32_t participants, const Arrived& arrived) {
  std::vector<uint32_t> missing;
  for (uint32_t p = 0; p < participants && missing.size() <= 16; ++p) {
    if (!arrived.count(p)) missing.push_back(p);
  }
  size_t shown = std::min<size_t>(missing.size(), 16);
  return fmt::format("{}{}", fmt::join(missing.begin(), missing.begin() + shown, ", "),
                     missing.size() > 16 ? ", ..." : "");
}

// Rounds open at once and payload bytes held, over all keys: one round per restoring job
// is the normal load; a peer that opens rounds without end is refused, not obeyed.
constexpr size_t kMaxOpenRounds = 4096;
constexpr size_t kMaxHeldBytes = size_t{256} << 20;

}  // namespace

const GatherTable::Distinct& GatherTable::Completed::GetDistinct() {
  std::call_once(distinct_once, [&] {
    std::map<std::string_view, size_t> index;
    for (uint32_t p = 0; p < payloads.size(); ++p) {
      auto [it, first] = index.try_emplace(payloads[p], distinct.payloads.size());
      if (first) {
        distinct.payloads.push_back(payloads[p]);
        distinct.senders.push_back(p);
        distinct.counts.push_back(0);
      }
      ++distinct.counts[it->second];
    }
  });
  return distinct;
}

namespace {

// A status of its own for a waiter on another thread: a copy would share the failing
// thread's, whose reference count lives in Debian's Abseil, out of TSan's sight (it took
// the last release for a race).
absl::Status OwnCopy(const absl::Status& status) { return absl::Status(status.code(), status.message()); }

}  // namespace

void GatherTable::Arrive(const std::string& key, uint32_t participant, uint32_t participants,
                         std::string payload, Clock::time_point deadline, Done done) {
  ArriveWith(key, participant, participants, std::move(payload), deadline,
             [done = std::move(done)](const absl::Status& failed, Completed* c) {
               if (c == nullptr) return done(OwnCopy(failed));
               done(c->payloads);
             });
}

void GatherTable::ArriveDistinct(const std::string& key, uint32_t participant, uint32_t participants,
                                 std::string payload, Clock::time_point deadline, DistinctDone done) {
  ArriveWith(key, participant, participants, std::move(payload), deadline,
             [done = std::move(done)](const absl::Status& failed, Completed* c) {
               if (c == nullptr) return done(OwnCopy(failed));
               done(c->GetDistinct());
             });
}

void GatherTable::ArriveWith(const std::string& key, uint32_t participant, uint32_t participants,
                             std::string payload, Clock::time_point deadline, Finish done) {
  if (participants == 0 || participant >= participants) {
    done(absl::InvalidArgumentError(fmt::format(
             "gather {}: participant {} is not in 0..{}", key, participant,
             participants == 0 ? 0 : participants - 1)),
         nullptr);
    return;
  }
  std::vector<Finish> replaced;
  std::vector<Finish> finish;
  auto completed = std::make_shared<Completed>();
  std::string refused;
  {
    std::unique_lock lock(mu_);
    if (!closed_.empty()) {
      std::string closed = closed_;
      lock.unlock();
      done(absl::UnavailableError(closed), nullptr);
      return;
    }
    if ((!rounds_.count(key) && rounds_.size() >= kMaxOpenRounds) ||
        held_bytes_ + payload.size() > kMaxHeldBytes) {
      lock.unlock();
      done(absl::ResourceExhaustedError(fmt::format(
               "gather {}: too many gathers in progress ({} rounds, {} bytes held)", key,
               kMaxOpenRounds, kMaxHeldBytes)),
           nullptr);
      return;
    }
    auto [it, inserted] = rounds_.try_emplace(key);
    Round& round = it->second;
    if (inserted) {
      round.participants = participants;
      round.started = Clock::now();
    } else if (round.participants != participants) {
      // Reported to this participant only: the round keeps its size.
      refused = fmt::format(
          "gather {}: participant {} says {} participants, the round in progress has {}", key,
          participant, participants, round.participants);
    }
    if (refused.empty()) {
      if (auto old = round.arrived.find(participant); old != round.arrived.end()) {
        replaced.push_back(std::move(old->second.done));
        held_bytes_ -= old->second.payload.size();
        round.arrived.erase(old);
      }
      held_bytes_ += payload.size();
      round.arrived.emplace(participant, Arrival{std::move(payload), deadline, std::move(done)});
      if (round.arrived.size() == round.participants) {
        completed->payloads.reserve(round.participants);
        for (auto& [p, arrival] : round.arrived) {
          held_bytes_ -= arrival.payload.size();
          completed->payloads.push_back(std::move(arrival.payload));
          finish.push_back(std::move(arrival.done));
        }
        rounds_.erase(it);
      }
    }
  }
  if (!refused.empty()) {
    done(absl::InvalidArgumentError(refused), nullptr);
    return;
  }
  for (Finish& d : replaced) {
    d(absl::AbortedError(fmt::format("gather {}: participant {} arrived again", key, participant)), nullptr);
  }
  for (Finish& d : finish) d(absl::OkStatus(), completed.get());
}

void GatherTable::Expire(Clock::time_point now) {
  std::vector<std::pair<Finish, std::string>> expired;
  {
    std::lock_guard lock(mu_);
    for (auto it = rounds_.begin(); it != rounds_.end();) {
      Round& round = it->second;
      std::string missing;
      for (auto a = round.arrived.begin(); a != round.arrived.end();) {
        if (a->second.deadline > now) {
          ++a;
          continue;
        }
        if (missing.empty()) missing = Missing(round.participants, round.arrived);
        double waited = std::chrono::duration<double>(now - round.started).count();
        expired.emplace_back(
            std::move(a->second.done),
            fmt::format("{}: timed out after {:.1f} s with {} of {} arrived; missing: {}",
                        it->first, waited, round.arrived.size(), round.participants, missing));
        held_bytes_ -= a->second.payload.size();
        a = round.arrived.erase(a);
      }
      it = round.arrived.empty() ? rounds_.erase(it) : std::next(it);
    }
  }
  for (auto& [done, why] : expired) done(absl::DeadlineExceededError(why), nullptr);
}

void GatherTable::Close(const std::string& why) { FailAll(why, /*close=*/true); }

void GatherTable::FailAll(const std::string& why) { FailAll(why, /*close=*/false); }

void GatherTable::FailAll(const std::string& why, bool close) {
  std::vector<Finish> failed;
  {
    std::lock_guard lock(mu_);
    if (close) closed_ = why.empty() ? "closed" : why;
    for (auto& [key, round] : rounds_) {
      for (auto& [p, arrival] : round.arrived) failed.push_back(std::move(arrival.done));
    }
    rounds_.clear();
    held_bytes_ = 0;
  }
  for (Finish& d : failed) d(absl::UnavailableError(why), nullptr);
}

template <typename Result, typename Start>
absl::StatusOr<Result> GatherTable::Wait(Clock::time_point deadline, Start start) {
  struct Waiting {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<absl::StatusOr<Result>> value;
  };
  auto result = std::make_shared<Waiting>();
  start([result](absl::StatusOr<Result> r) {
    std::lock_guard lock(result->mu);
    result->value = std::move(r);
    result->cv.notify_all();
  });
  std::unique_lock lock(result->mu);
  while (!result->value) {
    // Nobody else may be expiring this table: whoever waits past its deadline does it.
    if (result->cv.wait_until(lock, deadline + std::chrono::milliseconds(5)) ==
        std::cv_status::timeout) {
      lock.unlock();
      Expire(Clock::now());
      lock.lock();
    }
  }
  return std::move(*result->value);
}

absl::StatusOr<std::vector<std::string>> GatherTable::ArriveAndWait(
    const std::string& key, uint32_t participant, uint32_t participants, std::string payload,
    std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  return Wait<std::vector<std::string>>(deadline, [&](Done done) {
    Arrive(key, participant, participants, std::move(payload), deadline, std::move(done));
  });
}

absl::StatusOr<GatherTable::Distinct> GatherTable::ArriveDistinctAndWait(
    const std::string& key, uint32_t participant, uint32_t participants, std::string payload,
    std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  return Wait<Distinct>(deadline, [&](DistinctDone done) {
    ArriveDistinct(key, participant, participants, std::move(payload), deadline, std::move(done));
  });
}

size_t GatherTable::open_rounds() const {
  std::lock_guard lock(mu_);
  return rounds_.size();
}

}  // namespace ckpt::group
