#include "daemon/metrics/daemon_metrics.h"

namespace ckpt::metrics {

const char* CauseName(Cause cause) {
  switch (cause) {
    case Cause::kBudget: return "budget";
    case Cause::kStorage: return "storage";
    case Cause::kGroup: return "group";
    case Cause::kTimeout: return "timeout";
    case Cause::kTrainer: return "trainer";
    case Cause::kQuota: return "quota";
  }
  return "unknown";
}

DaemonMetrics::DaemonMetrics()
    : snapshot_seconds(registry.AddHistogram(
          {"ckptd_snapshot_seconds",
           "Seconds from ckptd taking a snapshot command to releasing the trainer (what a trainer "
           "waiting for staged waits).",
           {}})),
      staging_seconds(registry.AddHistogram(
          {"ckptd_staging_seconds", "Seconds copying a snapshot's registered buffers into staging memory.", {}})),
      write_seconds(registry.AddHistogram(
          {"ckptd_write_seconds", "Seconds writing one rank's shard to this node's store.", {"tier"}})),
      commit_seconds(registry.AddHistogram(
          {"ckptd_commit_seconds",
           "Seconds to commit a step: scope=node from its first snapshot staged here to committed; "
           "scope=group the group's round, from this node's ranks durable to the decision.",
           {"scope"}})),
      restore_seconds(registry.AddHistogram(
          {"ckptd_restore_seconds", "Seconds restoring one rank, by the tier its bytes came from.", {"tier"}})),
      upload_seconds(registry.AddHistogram(
          {"ckptd_upload_seconds", "Seconds uploading one step's files of this node to the remote tier.", {}})),
      staged_bytes(registry.AddCounter(
          {"ckptd_staged_bytes_total",
           "Bytes copied from trainers into staging memory (registered buffers and train state; not frozen "
           "tensors shared with earlier snapshots).",
           {}})),
      frozen_shared_bytes(registry.AddCounter(
          {"ckptd_frozen_skipped_bytes_total",
           "Bytes of frozen tensors not copied from trainers: shared with the session's earlier snapshots, in the "
           "frozen block one of them staged.",
           {}})),
      frozen_changes(registry.AddCounter(
          {"ckptd_frozen_changes_total",
           "Frozen tensors that a periodic check (--frozen-check-every) found changed in place, and saved.", {}})),
      written_bytes(registry.AddCounter(
          {"ckptd_written_bytes_total", "Bytes of shards written to this node's store.", {"tier"}})),
      restored_bytes(registry.AddCounter(
          {"ckptd_restored_bytes_total", "Bytes restored into trainers, by the tier they came from.", {"tier"}})),
      uploaded_bytes(registry.AddCounter(
          {"ckptd_uploaded_bytes_total", "Bytes uploaded to the remote tier.", {}})),
      snapshots(registry.AddCounter(
          {"ckptd_snapshots_total", "Snapshot commands by outcome: staged, rejected (not taken), failed.",
           {"outcome"}})),
      checkpoints(registry.AddCounter(
          {"ckptd_checkpoints_total", "Steps this node decided, by outcome: committed, failed.", {"outcome"}})),
      failures(registry.AddCounter(
          {"ckptd_failures_total",
           "Snapshots and checkpoints not taken or not committed, by cause: budget (staging memory), "
           "storage, group, timeout, trainer, quota.",
           {"cause"}})),
      upload_errors(registry.AddCounter(
          {"ckptd_upload_errors_total",
           "Failed attempts to upload a step to the remote tier, by cause: unavailable (no connection), timeout, "
           "refused (credentials, permissions), no_space, not_found, corrupt, other.",
           {"cause"}})),
      replication_errors(registry.AddCounter(
          {"ckptd_replication_errors_total",
           "Steps of this node not replicated to its coding group, by cause: unavailable (a holder not in the "
           "group or not answering), timeout, refused, no_space (a holder's replica memory), superseded (a newer "
           "step was staged before its shards were sent), not_found, corrupt, other.",
           {"cause"}})),
      replication_sent_bytes(registry.AddCounter(
          {"ckptd_replication_sent_bytes_total",
           "Bytes of fragments this node sent to its coding group: whole fragments, and the changed chunks of those "
           "sent as patches of the step its holders hold.",
           {}})),
      replication_unchanged_bytes(registry.AddCounter(
          {"ckptd_replication_unchanged_bytes_total",
           "Bytes of fragments this node did not send because they had not changed since the step its holders "
           "hold (sent as patches of it).",
           {}})) {
  // Every label value of the fixed sets is exported from the start at 0: an alert on a
  // rate sees the series before the first failure, a dashboard its panels before the first
  // checkpoint.
  for (auto* h : {&snapshot_seconds, &staging_seconds, &upload_seconds}) h->With({});
  write_seconds.With({"local"});
  commit_seconds.With({"node"});
  for (const char* tier : {"memory", "disk"}) {
    restore_seconds.With({tier});
    restored_bytes.With({tier});
  }
  for (auto* c : {&staged_bytes, &uploaded_bytes, &frozen_shared_bytes, &frozen_changes, &replication_sent_bytes,
                  &replication_unchanged_bytes}) {
    c->With({});
  }
  written_bytes.With({"local"});
  for (Cause c : {Cause::kBudget, Cause::kStorage, Cause::kGroup, Cause::kTimeout, Cause::kTrainer, Cause::kQuota}) {
    failures.With({CauseName(c)});
  }
  for (std::string_view cause : ErrorCauses()) {
    upload_errors.With({std::string(cause)});
    replication_errors.With({std::string(cause)});
  }
  replication_errors.With({"superseded"});
  for (const char* outcome : {"staged", "rejected", "failed"}) snapshots.With({outcome});
  for (const char* outcome : {"committed", "failed"}) checkpoints.With({outcome});
}

DaemonMetrics& Metrics() {
  static DaemonMetrics* metrics = new DaemonMetrics();  // never destroyed: threads may record at exit
  return *metrics;
}

}  // namespace ckpt::metrics
