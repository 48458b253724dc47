// What a scrape exports of where each job's checkpoints are durable, beside the node's own
// figures (node_figures.h): per job the newest step in each tier (local, global, remote,
// replicated) and its commit time, the steps in flight, the upload backlog; per user the
// bytes on the root against --user-quota-bytes; the group's contact with its coordinator and,
// on the coordinator only, each member's state and heartbeat age. Read from the same
// StatusReply `ckptctl status` is built from, so that /metrics and status never disagree.
//
// Cardinality: jobs are the 64 most recently committed (kMaxLabelled; additive figures of the
// rest summed under "_other", the rest's steps left out), users 64 (the rest summed under
// "_other"), members one series each on node 0 alone (every other node exports none).
#pragma once

#include <vector>

#include "daemon/metrics/last_commits.h"
#include "daemon/metrics/registry.h"
#include "daemon/persist/disk_quota.h"
#include "proto/admin.pb.h"

namespace ckpt::daemon {

struct DurabilitySources {
  // Status as a scrape fills it: the jobs of `commits` first (newest first), then any with
  // steps in flight (each job's pending_steps: written or committing), the group section and
  // each job's global, replicated and remote steps and uploads where the node has them.
  const ::ckptd::v1::StatusReply& status;
  // Each job's newest committed step on this node and its time (found on disk at start, then
  // each commit), the 64 most recent.
  const std::vector<metrics::LastCommits::Commit>& commits;
  const persist::DiskQuota* quota = nullptr;  // --user-quota-bytes / --job-quota-bytes; null: none
};

void CollectDurabilityFigures(const DurabilitySources& sources, metrics::Exposition& out);

}  // namespace ckpt::daemon
