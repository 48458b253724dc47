// Where the coordinator records its commit decisions before announcing them, so that a
// coordinator that restarts answers "committed" for every step it ever announced as such.
// Aborts are not recorded: a step with no record is presumed aborted (docs/format.md).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "storage/filesystem.h"

namespace ckpt::group {

class DecisionLog {
 public:
  virtual ~DecisionLog() = default;
  // Durable when it returns OK: the decision record (committed_step.h, DecisionRecordJson),
  // O(ranks) bytes. On the commit path: nothing is announced before it returns.
  virtual absl::Status RecordCommit(const std::string& job, uint64_t step,
                                    const std::string& record_json) = 0;
  // The recorded decision, or nullopt when the step was never committed (or the record
  // was pruned long after). Logs written by older ckptd hold the whole manifest instead.
  virtual absl::StatusOr<std::optional<std::string>> FindCommit(const std::string& job,
                                                                uint64_t step) = 0;
  // The whole step's manifest, written once it is assembled, after the decision was
  // announced: for node 0, and for a node that asks for it after a coordinator restart. On a
  // shared root, the manifest (or index) the coordinator publishes, written before the
  // decision: what a restarted coordinator publishes the step from.
  virtual absl::Status RecordManifest(const std::string& job, uint64_t step,
                                      const std::string& manifest_json) = 0;
  // nullopt when it was never recorded (the coordinator stopped in between) or pruned;
  // ResourceExhausted when it is larger than `max_bytes`.
  virtual absl::StatusOr<std::optional<std::string>> FindManifest(const std::string& job, uint64_t step,
                                                                  size_t max_bytes) = 0;
  // Removes the step's recorded manifest (none: OK): a new run saves the step number again,
  // and the earlier commit's manifest must never be taken for the new one's. The earlier
  // decision record stays until the new one replaces it.
  virtual absl::Status ForgetManifest(const std::string& job, uint64_t step) = 0;
};

using DecisionLogPtr = std::unique_ptr<DecisionLog>;

// One file per committed step under `dir`/<job>/step-NNNNNNNN.json and its manifest beside
// it (step-NNNNNNNN.manifest.json), written atomically; keeps the newest `keep_per_job`
// steps of each job.
DecisionLogPtr MakeFileDecisionLog(FilesystemPtr fs, std::string dir, size_t keep_per_job = 1024);

}  // namespace ckpt::group
