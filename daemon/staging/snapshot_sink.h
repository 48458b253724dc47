// Where the stager hands a laid-out snapshot: the persist stage, which the stager does not
// know (tests hand it to a fake).
#pragma once

#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

class SnapshotSink {
 public:
  virtual ~SnapshotSink() = default;
  // Takes the snapshot before its bytes have landed (see StagedSnapshot::landed). Never
  // blocks on storage.
  virtual void Submit(StagedSnapshotPtr snapshot) = 0;
};

}  // namespace ckpt::daemon
