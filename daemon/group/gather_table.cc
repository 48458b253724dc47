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

std::vector<std::string> GatherTable::Completed::Payloads() const {
  std::vector<std::string> out;
  out.reserve(by_participant.size());
  for (const std::string* payload : by_participant) out.push_back(*payload);
  return out;
}

const GatherTable::Distinct& GatherTable::Completed::GetDistinct() {
  std::call_once(distinct_once, [&] {
    std::map<std::string_view, size_t> index;
    const std::string* last = nullptr;  // merged participants share one payload: one lookup
    size_t last_index = 0;
    for (uint32_t p = 0; p < by_participant.size(); ++p) {
      const std::string* payload = by_participant[p];
      if (payload != last) {
        auto [it, first] = index.try_emplace(*payload, distinct.payloads.size());
        if (first) {
          distinct.payloads.push_back(*payload);
          distinct.senders.push_back(p);
          distinct.counts.push_back(0);
        }
        last = payload;
        last_index = it->second;
      }
      ++distinct.counts[last_index];
    }
  });
  return distinct;
}

absl::Status GatherTable::OwnCopy(const absl::Status& status) { return absl::Status(status.code(), status.message()); }

std::string GatherTable::Invalid(const std::string& key, uint32_t participants, const std::vector<Sent>& sent) {
  if (sent.empty()) return fmt::format("gather {}: an arrival with no participant", key);
  std::vector<uint32_t> all;
  for (const Sent& s : sent) {
    if (s.participants.empty()) return fmt::format("gather {}: a payload sent by no participant", key);
    for (uint32_t p : s.participants) {
      if (participants == 0 || p >= participants) {
        return fmt::format("gather {}: participant {} is not in 0..{}", key, p, participants == 0 ? 0 : participants - 1);
      }
      all.push_back(p);
    }
  }
  std::sort(all.begin(), all.end());
  if (auto twice = std::adjacent_find(all.begin(), all.end()); twice != all.end()) {
    return fmt::format("gather {}: participant {} is named twice in one arrival", key, *twice);
  }
  return {};
}

void GatherTable::Arrive(const std::string& key, uint32_t participant, uint32_t participants,
                         std::string payload, Clock::time_point deadline, Done done) {
  std::vector<Sent> sent;
  sent.push_back({std::move(payload), {participant}});
  ArriveWith(key, participants, std::move(sent), deadline,
             [done = std::move(done)](const absl::Status& failed, Completed* c) {
               if (c == nullptr) return done(OwnCopy(failed));
               done(c->Payloads());
             });
}

void GatherTable::ArriveDistinct(const std::string& key, uint32_t participant, uint32_t participants,
                                 std::string payload, Clock::time_point deadline, DistinctDone done) {
  std::vector<Sent> sent;
  sent.push_back({std::move(payload), {participant}});
  ArriveMerged(key, participants, std::move(sent), deadline, std::move(done));
}

void GatherTable::ArriveMerged(const std::string& key, uint32_t participants, std::vector<Sent> sent,
                               Clock::time_point deadline, DistinctDone done) {
  ArriveWith(key, participants, std::move(sent), deadline,
             [done = std::move(done)](const absl::Status& failed, Completed* c) {
               if (c == nullptr) return done(OwnCopy(failed));
               done(c->GetDistinct());
             });
}

void GatherTable::ArriveWith(const std::string& key, uint32_t participants, std::vector<Sent> sent,
                             Clock::time_point deadline, Finish done) {
  if (std::string invalid = Invalid(key, participants, sent); !invalid.empty()) {
    done(absl::InvalidArgumentError(invalid), nullptr);
    return;
  }
  auto arrival = std::make_shared<Arrival>();
  for (const Sent& s : sent) arrival->bytes += s.payload.size() + kBytesPerParticipant * s.participants.size();
  std::vector<std::pair<Finish, uint32_t>> replaced;  // with one of their participants
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
        held_bytes_ + arrival->bytes > kMaxHeldBytes) {
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
      // Reported to this arrival only: the round keeps its size.
      refused = fmt::format("gather {}: participant {} says {} participants, the round in progress has {}", key,
                            sent.front().participants.front(), participants, round.participants);
    }
    if (refused.empty()) {
      arrival->deadline = deadline;
      arrival->done = std::move(done);
      held_bytes_ += arrival->bytes;
      round.arrivals.push_back(arrival);
      for (Sent& s : sent) {
        const auto index = static_cast<uint32_t>(arrival->payloads.size());
        for (uint32_t p : s.participants) {
          auto [slot, fresh] = round.arrived.try_emplace(p, Slot{arrival, index});
          ++arrival->live;
          if (fresh) continue;
          // A retry: the participant's newest arrival holds it. The one before is told so
          // once none of its participants is left (and leaves the round below, at once).
          Arrival& before = *slot->second.arrival;
          if (--before.live == 0) {
            replaced.emplace_back(std::move(before.done), p);
            held_bytes_ -= before.bytes;
          }
          slot->second = Slot{arrival, index};
        }
        arrival->payloads.push_back(std::move(s.payload));
      }
      if (!replaced.empty()) {
        std::erase_if(round.arrivals, [](const std::shared_ptr<Arrival>& a) { return a->live == 0; });
      }
      if (round.arrived.size() == round.participants) {
        completed->by_participant.reserve(round.participants);
        for (auto& [p, slot] : round.arrived) {
          completed->by_participant.push_back(&slot.arrival->payloads[slot.payload]);
        }
        for (std::shared_ptr<Arrival>& a : round.arrivals) {
          held_bytes_ -= a->bytes;
          finish.push_back(std::move(a->done));
          completed->arrivals.push_back(std::move(a));
        }
        rounds_.erase(it);
      }
    }
  }
  if (!refused.empty()) {
    done(absl::InvalidArgumentError(refused), nullptr);
    return;
  }
  for (auto& [d, participant] : replaced) {
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
      // The expired arrivals first, then their participants in one pass: a round of
      // 80,000 participants may have thousands of arrivals.
      std::vector<std::shared_ptr<Arrival>> late;
      for (const std::shared_ptr<Arrival>& a : round.arrivals) {
        if (a->deadline <= now) late.push_back(a);
      }
      if (late.empty()) {
        ++it;
        continue;
      }
      const std::string missing = Missing(round.participants, round.arrived);
      const double waited = std::chrono::duration<double>(now - round.started).count();
      const std::string why = fmt::format("{}: timed out after {:.1f} s with {} of {} arrived; missing: {}",
                                          it->first, waited, round.arrived.size(), round.participants, missing);
      std::erase_if(round.arrived, [&](const auto& entry) { return entry.second.arrival->deadline <= now; });
      for (const std::shared_ptr<Arrival>& a : late) {
        expired.emplace_back(std::move(a->done), why);
        held_bytes_ -= a->bytes;
      }
      std::erase_if(round.arrivals, [&](const std::shared_ptr<Arrival>& a) { return a->deadline <= now; });
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
      for (std::shared_ptr<Arrival>& arrival : round.arrivals) failed.push_back(std::move(arrival->done));
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
