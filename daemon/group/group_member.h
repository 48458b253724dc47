// This node's life in the group: joins in the background (retrying with back-off while
// the coordinator starts), heartbeats every group_timeout/4, joins again when the
// coordinator has forgotten it (it restarted, or marked this node lost), and keeps the last
// view for `ckptctl status`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "daemon/group/group_client.h"
#include "daemon/group/group_options.h"

namespace ckpt::group {

class GroupMember {
 public:
  struct State {
    bool joined = false;           // the last join or heartbeat succeeded
    std::string last_error;        // of the last failed call, empty when none
    double last_ok_age_s = -1;     // since the last successful call; -1: never
    uint64_t joins = 0;            // how often this node (re)joined
    GroupViewData view;            // as of the last successful call
  };

  // `on_joined` runs on the member's thread after every successful (re)join: the node asks
  // for the outcome of steps it holds in doubt then. `on_view` gets every view the
  // coordinator answers with (after a join or a heartbeat).
  GroupMember(const GroupOptions& options, GroupClient& client, std::function<void()> on_joined,
              std::function<void(const GroupViewData&)> on_view = {});
  ~GroupMember();  // stops the thread
  GroupMember(const GroupMember&) = delete;
  GroupMember& operator=(const GroupMember&) = delete;

  State state() const;
  // Blocks until joined or `timeout`; true when joined.
  bool WaitJoined(std::chrono::milliseconds timeout) const;

 private:
  void Loop();

  const GroupOptions options_;
  GroupClient& client_;
  std::function<void()> on_joined_;
  std::function<void(const GroupViewData&)> on_view_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool stopping_ = false;
  State state_;
  std::chrono::steady_clock::time_point last_ok_{};
  std::thread thread_;
};

}  // namespace ckpt::group
