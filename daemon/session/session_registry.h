// The live sessions, by id and by (job, rank). Thread-safe; sessions whose trainer exited
// are reaped on the next registration or status read.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/session/session.h"

namespace ckpt::daemon {

class SessionRegistry {
 public:
  // Adds a started session. AlreadyExists if a live session holds the same (job, rank).
  absl::Status Add(SessionPtr session);
  absl::StatusOr<SessionPtr> Find(const std::string& id) const;
  // Find, for a call from `caller`: a session id is not a credential, so only the process
  // that registered the session may use it (PermissionDenied otherwise).
  absl::StatusOr<SessionPtr> FindFor(const std::string& id, const PeerIdentity& caller) const;
  // Removes and stops the session; NotFound if unknown.
  absl::Status Remove(const std::string& id);
  std::vector<SessionPtr> All() const;
  // Every session rejects new snapshots from now on (the start of shutdown).
  void RefuseNewSnapshots();
  // Stops and removes every session (shutdown).
  void Clear();

 private:
  // Removes ended sessions; returns them so they are destroyed outside the lock.
  std::vector<SessionPtr> ReapLocked();

  mutable std::mutex mu_;
  std::map<std::string, SessionPtr> sessions_;
};

}  // namespace ckpt::daemon
