// What a session reports as its snapshots go. The session stage knows only this interface;
// the control stage's status board implements it (and `ckptctl status` reads the board), so
// the dependency runs downward, from control to session.
#pragma once

#include <sys/types.h>

#include <string>

#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

class SessionEvents {
 public:
  virtual ~SessionEvents() = default;
  // Every byte of `snap` has landed in staging memory; `uid` is the trainer's.
  virtual void SnapshotStaged(const StagedSnapshotPtr& snap, uid_t uid) = 0;
  // A snapshot not taken; `why` names job, rank and step.
  virtual void SnapshotRejected(std::string why) = 0;
  // Something that ended or harmed the session, for operators.
  virtual void SessionError(std::string message) = 0;
};

}  // namespace ckpt::daemon
