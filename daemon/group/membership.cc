#include "daemon/group/membership.h"

#include <fmt/format.h>

#include <algorithm>

namespace ckpt::group {
namespace {

// "10.0.0.5:7000" -> "10.0.0.5", "[::1]:7000" -> "::1".
std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

const char* MemberStateName(MemberState state) {
  switch (state) {
    case MemberState::kWaiting: return "waiting";
    case MemberState::kAlive: return "alive";
    case MemberState::kLost: return "lost";
  }
  return "?";
}

Membership::Membership(uint32_t num_nodes, std::chrono::milliseconds timeout)
    : timeout_(timeout), members_(num_nodes) {}

absl::Status Membership::Join(uint32_t node, uint32_t num_nodes, const std::string& address,
                              uint64_t incarnation, bool* restarted, std::string_view domain) {
  *restarted = false;
  if (num_nodes != members_.size()) {
    return absl::FailedPreconditionError(fmt::format(
        "node {} was started with --num-nodes {}, the coordinator with {}", node, num_nodes,
        members_.size()));
  }
  if (node >= members_.size()) {
    return absl::InvalidArgumentError(
        fmt::format("node rank {} is not in 0..{}", node, members_.size() - 1));
  }
  if (incarnation == 0) return absl::InvalidArgumentError("incarnation 0 is reserved");
  std::lock_guard lock(mu_);
  Member& m = members_[node];
  if (m.state == MemberState::kAlive && m.incarnation != incarnation &&
      HostOf(m.address) != HostOf(address)) {
    // A daemon that restarts comes back from its own host; one from another host while the
    // first still heartbeats is a second daemon with the same --node-rank. Retryable, so a
    // genuine replacement elsewhere gets in once the old one is marked lost.
    return absl::UnavailableError(fmt::format(
        "node {} is alive at {} under another incarnation: is a second daemon (at {}) started "
        "with --node-rank {}? It is admitted once the first is marked lost (--group-timeout)",
        node, m.address, address.substr(0, 256), node));
  }
  *restarted = m.incarnation != 0 && m.incarnation != incarnation;
  const std::string advertised = address.substr(0, 256);
  if (m.state != MemberState::kAlive || m.address != advertised || m.incarnation != incarnation ||
      m.domain != domain) {
    ChangedLocked(node);
  }
  m.domain = std::string(domain);
  m.address = advertised;
  m.incarnation = incarnation;
  m.state = MemberState::kAlive;
  m.last_heard = Clock::now();
  next_expiry_ = std::min(next_expiry_, m.last_heard + timeout_);
  return absl::OkStatus();
}

absl::Status Membership::Heartbeat(uint32_t node, uint64_t incarnation) {
  if (node >= members_.size()) {
    return absl::InvalidArgumentError(
        fmt::format("node rank {} is not in 0..{}", node, members_.size() - 1));
  }
  std::lock_guard lock(mu_);
  Member& m = members_[node];
  if (m.incarnation != incarnation || m.state == MemberState::kWaiting) {
    return absl::FailedPreconditionError(
        fmt::format("node {} is not joined under incarnation {:x}: join first", node, incarnation));
  }
  if (m.state == MemberState::kLost) {
    // A lost member comes back only by joining again, so that the coordinator and the node
    // agree on what happened to steps in between.
    return absl::FailedPreconditionError(fmt::format("node {} was marked lost: join again", node));
  }
  m.last_heard = Clock::now();
  return absl::OkStatus();
}

std::vector<LostMember> Membership::Expire(Clock::time_point now) {
  std::vector<LostMember> lost;
  const auto wall_now = std::chrono::system_clock::now();
  std::lock_guard lock(mu_);
  // Heartbeats only move last_heard later: no member can expire before the earliest
  // deadline the last walk saw (or a join since set). The walk over 10,000 members (a cache
  // miss each) then runs about once a timeout instead of every tick.
  if (now <= next_expiry_) return lost;
  next_expiry_ = Clock::time_point::max();
  for (uint32_t n = 0; n < members_.size(); ++n) {
    Member& m = members_[n];
    if (m.state != MemberState::kAlive) continue;
    if (now - m.last_heard <= timeout_) {
      next_expiry_ = std::min(next_expiry_, m.last_heard + timeout_);
    } else {
      m.state = MemberState::kLost;
      ChangedLocked(n);
      const auto silent_since = wall_now - std::chrono::duration_cast<std::chrono::system_clock::duration>(now - m.last_heard);
      lost.push_back({n,
                      fmt::format("node {} ({}) lost: no heartbeat for {:.1f} s", n, m.address,
                                  std::chrono::duration<double>(now - m.last_heard).count()),
                      m.changed_in,
                      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                silent_since.time_since_epoch())
                                                .count())});
    }
  }
  return lost;
}

size_t Membership::Resumed(Clock::time_point now) {
  const Clock::time_point grace_from = now - timeout_ / 2;
  size_t given = 0;
  std::lock_guard lock(mu_);
  for (Member& m : members_) {
    if (m.state != MemberState::kAlive || m.last_heard >= grace_from) continue;
    m.last_heard = grace_from;
    ++given;
  }
  // Deadlines only moved later: the next walk may come later too, but never misses one.
  if (given > 0) next_expiry_ = Clock::time_point::min();
  return given;
}

uint64_t Membership::VersionOf(uint32_t node) const {
  std::lock_guard lock(mu_);
  return node < members_.size() ? members_[node].changed_in : 0;
}

MemberView Membership::ViewOf(uint32_t node, Clock::time_point now) const {
  const Member& m = members_[node];
  double age = m.state == MemberState::kWaiting
                   ? -1
                   : std::chrono::duration<double>(now - m.last_heard).count();
  return {node, m.address, m.state, age, m.incarnation, m.domain};
}

std::optional<MemberView> Membership::MemberOf(uint32_t node) const {
  std::lock_guard lock(mu_);
  if (node >= members_.size()) return std::nullopt;
  return ViewOf(node, Clock::now());
}

std::vector<MemberView> Membership::View() const {
  uint64_t version;
  return Changes(0, &version);
}

void Membership::ChangedLocked(uint32_t node) {
  members_[node].changed_in = ++version_;
  changes_.emplace_back(version_, node);
  if (changes_.size() > 2 * members_.size() + 64) {
    std::erase_if(changes_, [&](const auto& c) { return members_[c.second].changed_in != c.first; });
  }
}

std::vector<MemberView> Membership::Changes(uint64_t since, uint64_t* version) const {
  std::vector<MemberView> view;
  auto now = Clock::now();
  std::lock_guard lock(mu_);
  *version = version_;
  if (since == 0 || since > version_) {  // nothing known, or not a version of this table
    view.reserve(members_.size());
    for (uint32_t n = 0; n < members_.size(); ++n) view.push_back(ViewOf(n, now));
    return view;
  }
  auto first = std::upper_bound(changes_.begin(), changes_.end(), std::make_pair(since, UINT32_MAX));
  for (auto it = first; it != changes_.end(); ++it) {
    if (members_[it->second].changed_in == it->first) view.push_back(ViewOf(it->second, now));
  }
  std::sort(view.begin(), view.end(), [](const MemberView& a, const MemberView& b) { return a.node < b.node; });
  return view;
}

}  // namespace ckpt::group
