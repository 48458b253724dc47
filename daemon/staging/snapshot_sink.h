// Where the stager hands a laid-out snapshot: the persist stage, which the stager does not
// know (tests hand it to a fake).
#pragma once

#include <cstdint>
#include <string>

#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

class SnapshotSink {
 public:
  virtual ~SnapshotSink() = default;
  // Takes the snapshot before its bytes have landed (see StagedSnapshot::landed). Never
  // blocks on storage.
  virtual void Submit(StagedSnapshotPtr snapshot) = 0;
  // A rank's snapshot of (job, step) was refused before it was staged: the step cannot
  // complete (persist::WriteListener::Refused).
  virtual void Refused(const std::string& job, uint64_t step, uint32_t rank, const std::string& why) = 0;
};

}  // namespace ckpt::daemon
