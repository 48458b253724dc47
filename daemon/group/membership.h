// The coordinator's table of the static group: nodes 0..num_nodes-1, each waiting, alive
// or lost. A node joins with a random incarnation; a join with a new incarnation is a
// restart. A member whose heartbeats stop for the group timeout is lost. Pure logic.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace ckpt::group {

enum class MemberState { kWaiting, kAlive, kLost };

struct MemberView {
  uint32_t node = 0;
  std::string address;
  MemberState state = MemberState::kWaiting;
  double last_heartbeat_age_s = -1;
  uint64_t incarnation = 0;
  std::string domain;  // --failure-domain; empty: none declared
};

// A member Expire marked lost.
struct LostMember {
  uint32_t node = 0;
  std::string why;
  uint64_t version = 0;               // of the membership change that marked it lost
  uint64_t silent_since_unix_ns = 0;  // its last heartbeat, on the wall clock
};

class Membership {
 public:
  using Clock = std::chrono::steady_clock;

  Membership(uint32_t num_nodes, std::chrono::milliseconds timeout);

  // `restarted` is set when the node was known under another incarnation. `domain`: the
  // node's --failure-domain.
  absl::Status Join(uint32_t node, uint32_t num_nodes, const std::string& address,
                    uint64_t incarnation, bool* restarted, std::string_view domain = {});
  // FailedPrecondition when the node must join (again) first.
  absl::Status Heartbeat(uint32_t node, uint64_t incarnation);
  // Marks members silent for longer than the timeout as lost; returns them with why.
  std::vector<LostMember> Expire(Clock::time_point now);
  // The coordinator itself did not run for a while (its ticker woke `stalled` late: CPU
  // starved or throttled, the process paused): members' silence in that time is no
  // evidence against them, since their heartbeats may be waiting to be read. Each alive
  // member gets half a timeout from `now` to be heard before Expire may mark it lost.
  // Returns how many members were given that grace.
  size_t Resumed(Clock::time_point now);
  // The version of `node`'s last change (a join, a loss): orders what others learn of it.
  uint64_t VersionOf(uint32_t node) const;
  std::vector<MemberView> View() const;
  // One member, nullopt for a node outside the group.
  std::optional<MemberView> MemberOf(uint32_t node) const;
  // The members whose state, address or incarnation changed after version `since` (all of
  // them for 0, or a version this table never had), and the version they bring one to.
  std::vector<MemberView> Changes(uint64_t since, uint64_t* version) const;
  uint32_t num_nodes() const { return static_cast<uint32_t>(members_.size()); }

 private:
  struct Member {
    std::string address;
    MemberState state = MemberState::kWaiting;
    uint64_t incarnation = 0;
    std::string domain;
    Clock::time_point last_heard{};
    uint64_t changed_in = 0;  // the version of its last change
  };
  MemberView ViewOf(uint32_t node, Clock::time_point now) const;
  void ChangedLocked(uint32_t node);

  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::vector<Member> members_;
  uint64_t version_ = 1;  // 0 is "nothing known" in a heartbeat
  // (version, node) of every change, in version order, so that a heartbeat from a node
  // that knows the newest version costs O(1), not a scan of 10,000 members. Entries a
  // later change of the same node superseded are dropped when they reach num_nodes.
  std::vector<std::pair<uint64_t, uint32_t>> changes_;
  // No alive member's silence can exceed the timeout before this (Expire).
  Clock::time_point next_expiry_ = Clock::time_point::min();
};

const char* MemberStateName(MemberState state);

}  // namespace ckpt::group
