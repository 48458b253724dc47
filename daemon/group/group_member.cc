#include "daemon/group/group_member.h"

#include <algorithm>
#include <exception>

#include "common/log.h"
#include "common/status.h"

namespace ckpt::group {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

// One Join call retries for at most this long, so that the destructor never waits on a
// long join; the loop then simply tries again.
constexpr milliseconds kJoinAttempt{2'000};
constexpr milliseconds kRetryAfterFailure{100};

}  // namespace

GroupMember::GroupMember(const GroupOptions& options, GroupClient& client,
                         std::function<void()> on_joined,
                         std::function<void(const GroupViewData&)> on_view)
    : options_(options), client_(client), on_joined_(std::move(on_joined)),
      on_view_(std::move(on_view)) {
  thread_ = std::thread([this] { Loop(); });
}

GroupMember::~GroupMember() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

GroupMember::State GroupMember::state() const {
  std::lock_guard lock(mu_);
  State s = state_;
  if (last_ok_ != Clock::time_point{}) {
    s.last_ok_age_s = std::chrono::duration<double>(Clock::now() - last_ok_).count();
  }
  return s;
}

bool GroupMember::WaitJoined(milliseconds timeout) const {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return state_.joined; });
}

void GroupMember::Loop() {
  const milliseconds heartbeat_period =
      std::max<milliseconds>(options_.group_timeout / 4, milliseconds(10));
  bool must_join = true;  // the coordinator does not know this incarnation (yet)
  std::unique_lock lock(mu_);
  while (!stopping_) {
    lock.unlock();
    bool joined_now = false;
    const char* call = must_join ? "join" : "heartbeat";
    absl::StatusOr<GroupViewData> view;
    try {
      if (must_join) {
        view = client_.Join(Clock::now() + std::min(options_.group_timeout, kJoinAttempt));
        joined_now = view.ok();
      } else {
        view = client_.Heartbeat();
        // The coordinator restarted, or marked this node lost: only a new join helps.
        if (absl::IsFailedPrecondition(view.status())) must_join = true;
      }
      if (view.ok() && on_view_) on_view_(*view);
      if (joined_now) {
        must_join = false;
        // Steps this node holds in doubt are resolved now, before heartbeats resume.
        if (on_joined_) on_joined_();
      }
    } catch (const std::exception& e) {
      view = absl::InternalError(std::string("group member: unexpected exception: ") + e.what());
    } catch (...) {
      view = absl::InternalError("group member: unexpected exception");
    }
    lock.lock();
    if (view.ok()) {
      if (joined_now) {
        ++state_.joins;
        Log().info("node {} joined the group (join #{})", options_.node_rank, state_.joins);
      } else if (!state_.joined) {
        Log().info("node {}: the coordinator answers again", options_.node_rank);
      }
      state_.joined = true;
      state_.last_error.clear();
      state_.view = std::move(*view);
      last_ok_ = Clock::now();
    } else {
      std::string error = Message(view.status());
      // One line per change, not one per retry.
      if (state_.joined || error != state_.last_error) {
        Log().warn("node {}: group {} failed: {}", options_.node_rank, call, error);
      }
      state_.joined = false;
      state_.last_error = std::move(error);
    }
    cv_.notify_all();
    milliseconds pause = view.ok() || !must_join ? heartbeat_period : kRetryAfterFailure;
    // A join may bring only this node's relay (a group with a relay tree): the first
    // heartbeat, through it, brings the other members.
    if (joined_now && view.ok()) pause = milliseconds(0);
    cv_.wait_for(lock, pause, [&] { return stopping_; });
  }
}

}  // namespace ckpt::group
