// The daemon's metric families (docs/operators.md lists each): what every stage updates,
// in the one registry the --metrics-addr endpoint serves.
//
// One registry per process, found through Metrics(), as a Prometheus client's default
// registry is: every stage records into it without each constructor taking it, and tests
// that start real daemons scrape each daemon's own process.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "daemon/metrics/error_cause.h"
#include "daemon/metrics/registry.h"

namespace ckpt::metrics {

// Why a snapshot or checkpoint was not taken or not committed (ckptd_failures_total).
enum class Cause { kBudget, kStorage, kGroup, kTimeout, kTrainer, kQuota };
const char* CauseName(Cause cause);

struct DaemonMetrics {
  DaemonMetrics();

  Registry registry;
  // From ckptd taking a snapshot command off the ring to releasing the trainer: what a
  // trainer that waits for `staged` waits for.
  Family<Histogram>& snapshot_seconds;
  Family<Histogram>& staging_seconds;  // copying the registered buffers into staging memory
  Family<Histogram>& write_seconds;    // one rank's shard to this node's store, {tier}
  Family<Histogram>& commit_seconds;   // {scope}: node (first rank staged to committed), group round
  Family<Histogram>& restore_seconds;  // {tier}: memory, disk, remote
  Family<Histogram>& upload_seconds;   // one step's files of this node to the remote tier
  Family<Counter>& staged_bytes;
  Family<Counter>& frozen_shared_bytes;  // frozen tensors shared with earlier snapshots, not copied
  Family<Counter>& frozen_changes;       // frozen tensors a check found changed in place
  Family<Counter>& written_bytes;      // {tier}
  Family<Counter>& restored_bytes;     // {tier}
  Family<Counter>& uploaded_bytes;
  Family<Counter>& snapshots;          // {outcome}: staged, rejected, failed
  Family<Counter>& checkpoints;        // {outcome}: committed, failed
  Family<Counter>& failures;           // {cause}
  Family<Counter>& upload_errors;      // {cause}: error_cause.h
  Family<Counter>& replication_errors; // {cause}: error_cause.h, and superseded
  Family<Counter>& replication_sent_bytes;       // fragments' bytes sent to holders (whole, or patches' chunks)
  Family<Counter>& replication_unchanged_bytes;  // fragments' bytes not sent: unchanged, patched at the holders

  void Fail(Cause cause) { failures.With({CauseName(cause)}).Add(); }
  // A failed upload attempt, or a step not replicated, by what its status says.
  void UploadError(const absl::Status& status) { upload_errors.With({std::string(ErrorCause(status))}).Add(); }
  void ReplicationError(std::string_view cause) { replication_errors.With({std::string(cause)}).Add(); }
};

DaemonMetrics& Metrics();

}  // namespace ckpt::metrics
