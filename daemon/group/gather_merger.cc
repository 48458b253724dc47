#include "daemon/group/gather_merger.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <system_error>
#include <thread>

namespace ckpt::group {

GatherMerger::GatherMerger(std::string what, Send send, Limits limits)
    : what_(std::move(what)), send_(std::move(send)), limits_(limits) {}

GatherMerger::~GatherMerger() { Stop("stopping"); }

absl::Status GatherMerger::Arrive(const std::string& key, uint32_t participants, std::vector<Sent> sent,
                                  Clock::time_point deadline, Done done) {
  if (std::string invalid = GatherTable::Invalid(key, participants, sent); !invalid.empty()) {
    return absl::InvalidArgumentError(invalid);
  }
  size_t bytes = 0;
  std::vector<uint32_t> mine;
  for (const Sent& s : sent) {
    bytes += s.payload.size() + 2 * sizeof(uint32_t) * s.participants.size();  // listed, and seen
    mine.insert(mine.end(), s.participants.begin(), s.participants.end());
  }
  std::sort(mine.begin(), mine.end());
  std::lock_guard lock(mu_);
  if (!stopped_.empty()) return absl::UnavailableError(fmt::format("{}: {}", what_, stopped_));
  if (held_bytes_ + bytes > limits_.held_bytes) {
    return absl::ResourceExhaustedError(fmt::format("{}: {} bytes of gathers held already", what_, held_bytes_));
  }
  const MergeKey merge_key{key, participants};
  auto it = open_.find(merge_key);
  if (it != open_.end()) {
    // A participant already in the open merge (a retry), a deadline far from the merge's, or
    // a merge full: it goes up as it is.
    const Merge& open = *it->second;
    auto in_seen = [&](uint32_t p) { return std::binary_search(open.seen.begin(), open.seen.end(), p); };
    const bool apart = deadline + std::chrono::seconds(1) < open.deadline || open.deadline + std::chrono::seconds(1) < deadline;
    if (apart || open.bytes + bytes > limits_.merge_bytes || std::any_of(mine.begin(), mine.end(), in_seen)) {
      it->second->open = false;
      open_.erase(it);
      it = open_.end();
      cv_.notify_all();
    }
  }
  if (it == open_.end()) {
    if (merges_ >= limits_.merges) {
      return absl::ResourceExhaustedError(fmt::format("{}: {} merges in flight already", what_, merges_));
    }
    auto merge = std::make_shared<Merge>();
    merge->deadline = deadline;
    // Merges of this key already in flight: arrivals trickle in, so this one waits longer.
    const size_t before = in_flight_[merge_key];
    auto linger = limits_.linger;
    for (size_t i = 0; i < before && linger < limits_.max_linger; ++i) linger *= 2;
    linger = std::min(linger, limits_.max_linger);
    try {
      std::thread([this, merge_key, merge, linger] { Run(merge_key, merge, linger); }).detach();
    } catch (const std::system_error& e) {
      if (before == 0) in_flight_.erase(merge_key);
      return absl::ResourceExhaustedError(fmt::format("{}: no thread for a merge: {}", what_, e.what()));
    }
    ++in_flight_[merge_key];
    ++merges_;
    it = open_.emplace(merge_key, merge).first;
  }
  Merge& m = *it->second;
  for (Sent& s : sent) {
    std::vector<uint32_t>& by = m.by_payload[std::move(s.payload)];
    by.insert(by.end(), s.participants.begin(), s.participants.end());
  }
  std::vector<uint32_t> seen;
  seen.reserve(m.seen.size() + mine.size());
  std::merge(m.seen.begin(), m.seen.end(), mine.begin(), mine.end(), std::back_inserter(seen));
  m.seen = std::move(seen);
  m.deadline = std::min(m.deadline, deadline);
  m.waiting.push_back(std::move(done));
  m.bytes += bytes;
  held_bytes_ += bytes;
  ++counters_.arrivals;
  return absl::OkStatus();
}

void GatherMerger::Run(MergeKey key, std::shared_ptr<Merge> merge, std::chrono::milliseconds linger) {
  std::vector<Sent> sent;
  std::vector<Done> waiting;
  Clock::time_point deadline;
  std::string stopped;
  {
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, Clock::now() + linger, [&] { return !stopped_.empty() || !merge->open; });
    if (merge->open) {
      merge->open = false;
      open_.erase(key);
    }
    waiting = std::move(merge->waiting);
    deadline = merge->deadline;
    for (auto& [payload, participants] : merge->by_payload) sent.push_back({payload, std::move(participants)});
    merge->by_payload.clear();
    stopped = stopped_;
    if (stopped.empty()) ++counters_.merges;
  }
  const absl::StatusOr<GatherTable::Distinct> answer =
      stopped.empty() ? send_(key.first, key.second, sent, deadline)
                      : absl::UnavailableError(fmt::format("{}: {}", what_, stopped));
  for (Done& done : waiting) {
    done(answer.ok() ? answer : absl::StatusOr<GatherTable::Distinct>(GatherTable::OwnCopy(answer.status())));
  }
  std::lock_guard lock(mu_);
  held_bytes_ -= merge->bytes;
  if (auto it = in_flight_.find(key); it != in_flight_.end() && --it->second == 0) in_flight_.erase(it);
  --merges_;
  cv_.notify_all();
}

void GatherMerger::Stop(const std::string& why) {
  std::unique_lock lock(mu_);
  if (stopped_.empty()) stopped_ = why.empty() ? "stopped" : why;
  for (auto& [key, merge] : open_) merge->open = false;
  open_.clear();
  cv_.notify_all();
  cv_.wait(lock, [&] { return merges_ == 0; });
}

GatherMerger::Counters GatherMerger::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

}  // namespace ckpt::group
