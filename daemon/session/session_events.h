// What a session reports as its snapshots go. The session stage knows only this interface;
// the control stage's status board implements it (and `ckptctl status` reads the board), so
// the dependency runs downward, from control to session.
#pragma once

#include <string>

namespace ckpt::daemon {

class SessionEvents {
 public:
  virtual ~SessionEvents() = default;
  virtual void SnapshotStaged() = 0;
  // A snapshot not taken; `why` names job, rank and step.
  virtual void SnapshotRejected(std::string why) = 0;
  // Something that ended or harmed the session, for operators.
  virtual void SessionError(std::string message) = 0;
};

}  // namespace ckpt::daemon
