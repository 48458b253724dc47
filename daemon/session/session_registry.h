// The live sessions, by id and by (job, rank). Thread-safe. Its own thread beats every
// session's heartbeat (so a trainer sees ckptd alive while a long copy holds the session's
// thread, and stale only when the whole daemon stalls) and reaps sessions whose trainer
// exited, so their arenas are unmapped within a tick, not at the next registration.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/session/session.h"

namespace ckpt::daemon {

class SessionRegistry {
 public:
  static constexpr std::chrono::milliseconds kTick{100};

  SessionRegistry();
  ~SessionRegistry();
  SessionRegistry(const SessionRegistry&) = delete;
  SessionRegistry& operator=(const SessionRegistry&) = delete;

  // Adds a started session. AlreadyExists if a live session holds the same (job, rank).
  absl::Status Add(SessionPtr session);
  // Ends the session `caller` itself holds for (job, rank), if any: its own earlier session,
  // left behind when it stopped waiting for a stalled ckptd and registered again. Called
  // before the new registration is built, so that what the old one holds (arena budget,
  // memory) is given back first.
  void EndOwnSession(const std::string& job, uint32_t rank, const PeerIdentity& caller);
  absl::StatusOr<SessionPtr> Find(const std::string& id) const;
  // Find, for a call from `caller`: a session id is not a credential, so only the process
  // that registered the session may use it (PermissionDenied otherwise).
  absl::StatusOr<SessionPtr> FindFor(const std::string& id, const PeerIdentity& caller) const;
  // Removes and stops the session; NotFound if unknown.
  absl::Status Remove(const std::string& id);
  std::vector<SessionPtr> All() const;
  // How many live sessions job `job` has here: its ranks on this node.
  uint32_t RanksOf(const std::string& job) const;
  // Every session rejects new snapshots from now on (the start of shutdown).
  void RefuseNewSnapshots();
  // Stops and removes every session (shutdown).
  void Clear();
  // How long ago the ticker last beat the sessions' heartbeats (the watchdog's probe).
  std::chrono::nanoseconds SinceLastTick() const;

  // Test-only fault (CKPTD_FAULT=wedge-sessions-while:FILE, server.cc): holds the registry's
  // lock while `stalled()` says so, as a thread deadlocked while holding it would.
  // Registrations, snapshots, status and the heartbeat ticker all wait meanwhile.
  void HoldLockWhile(const std::function<bool()>& stalled);

 private:
  // Removes ended sessions; returns them so they are destroyed outside the lock.
  std::vector<SessionPtr> ReapLocked();
  void TickLoop();

  mutable std::mutex mu_;
  std::map<std::string, SessionPtr> sessions_;
  std::condition_variable wake_;
  bool stopping_ = false;  // guarded by mu_
  std::atomic<int64_t> last_tick_ns_{0};  // steady clock, at the ticker's last beat
  std::thread ticker_;     // last: started once everything above exists
};

}  // namespace ckpt::daemon
