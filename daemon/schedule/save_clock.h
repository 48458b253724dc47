// Where a rank asks "does the job save at this step?" when it saves by time: on one node the
// daemon's own SaveSchedule answers; in a group the coordinator's does, so that ranks on
// every node get the same answer (save_schedule.h says why one clock). One interface, two
// implementations, like StepAgreement.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/schedule/save_schedule.h"

namespace ckpt::group {
class GroupClient;
}  // namespace ckpt::group

namespace ckpt::daemon {

class SaveClock {
 public:
  virtual ~SaveClock() = default;
  // See SaveSchedule::Decide. In a group also Unavailable while the coordinator cannot be
  // reached: the rank then does not save (no rank can have been told to).
  virtual absl::StatusOr<bool> ShouldSave(const SaveQuestion& question) = 0;
};

using SaveClockPtr = std::unique_ptr<SaveClock>;

SaveClockPtr MakeLocalSaveClock();
// Remembers the coordinator's answers, so that a node's ranks ask it once per step.
SaveClockPtr MakeGroupSaveClock(group::GroupClient& client);

}  // namespace ckpt::daemon
